"""The on-chip learners of the fixed-point network (docs/hardware.md, docs/methods.md).

* :mod:`szo.hw.optim.onchip` -- :class:`OnChipSZO`, SZO's coordinates in integers (``hw.learner=integer``,
  ``qzo-subspace``);
* :mod:`szo.hw.optim.mcu` -- :class:`MCUZO`, seed 004's learner on the int8 weights (``mcu-zo``).
"""
