"""Pure functions (no state, no I/O)."""
from . import diagnostics, zo

__all__ = ["zo", "diagnostics"]
