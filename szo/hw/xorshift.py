"""XORShift32 and Rademacher draws: the pure generator lives in ``szo.functional.xorshift`` (the
forward-only core's Rademacher plans draw from it); this name is kept for ``szo.hw`` users."""
from szo.functional.xorshift import MASK32, XorShift32, rademacher

__all__ = ["MASK32", "XorShift32", "rademacher"]
