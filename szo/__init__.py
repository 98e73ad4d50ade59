"""szo: forward-only (zeroth-order) training of spiking neural networks in trajectory subspaces.

See docs/architecture.md for the module map and the interfaces between modules.
"""
__version__ = "0.1.0"
