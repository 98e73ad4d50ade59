"""How a command ends when it fails, torch-free: ``szo`` imports this before any command runs.

* :class:`RankFailure` (exit status 3): a peer of a torchrun run died or stopped answering
  (raised by ``szo.distributed``; rerun the same command with ``--resume``).
* :class:`TrainingDiverged` (exit status 4): non-finite or exploding loss, non-finite parameters
  (raised by ``szo.train.fit``; results.json of the run says ``"status": "diverged"``).
* :class:`ExternalError` (exit status 5): a process szo runs (the Lava interpreter of ``szo hw
  lava-check``) could not be started, failed, was killed or timed out. The CLI gives the same one line
  and status to an ``OSError`` that is not a missing file (a permission, a full disk, a path that is a
  file where a directory is needed): the operating system refused, not szo's input check.
* :func:`env_world_size`: torchrun's ``WORLD_SIZE``, which decides the ``[rank R/W]`` prefix of an
  error line and the hard exit of a failing rank.

``szo.distributed`` and ``szo.train`` re-export these names (their public home for library users).
"""
from __future__ import annotations

import os

__all__ = ["RankFailure", "TrainingDiverged", "ExternalError", "env_world_size"]


class RankFailure(RuntimeError):
    """A peer process died or stopped answering; the run can be continued with ``--resume``."""


class TrainingDiverged(ValueError):
    """Training diverged (non-finite or exploding loss, non-finite parameters); results.json
    of the run says ``"status": "diverged"``."""


class ExternalError(RuntimeError):
    """A process szo drives (not a torchrun peer) could not be started, failed, was killed or did not
    finish in time; the message is one line naming it and what to do."""


def env_world_size() -> int:
    """WORLD_SIZE as set by torchrun (1 when not launched by it)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ValueError(f"WORLD_SIZE must be an integer, got {os.environ.get('WORLD_SIZE')!r}") from None
