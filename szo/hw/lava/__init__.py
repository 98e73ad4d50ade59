"""The exchange with Intel Lava, the oracle of the ``loihi`` arithmetic (docs/hardware.md "Lava exchange").

* :mod:`szo.hw.lava.runner` -- the exchange format (bundles) and the script the Lava interpreter runs;
* :mod:`szo.hw.lava.bridge` -- szo's side: export a fixed-point network, run the interpreter, compare;
* :mod:`szo.hw.lava.check` -- ``szo hw lava-check``: a run's model against Lava, and the exchange export.
"""
