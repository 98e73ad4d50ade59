"""What ``szo hw-report`` measures and prints (docs/hardware.md "Memory / energy model").

* :mod:`szo.hw.reports.hw_report` -- the report of a run's model on the fixed-point backend;
* :mod:`szo.hw.reports.memory` -- seed 004's training-memory model;
* :mod:`szo.hw.reports.neurobench` -- NeuroBench's own metrics beside szo's counts.
"""
