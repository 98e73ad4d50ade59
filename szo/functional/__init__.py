"""Pure functions (no state, no I/O)."""
from . import zo

__all__ = ["zo"]
