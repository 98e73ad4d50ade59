"""Test-side fault injection for the torchrun CLI tests: ``python -m tests.fault_launcher RANK:STEP[:kill|hang]
szo-arguments...`` runs ``szo.cli.main(szo-arguments, callbacks=[...])`` where rank RANK kills itself
(SIGKILL) right after optimizer step STEP, or (``hang``) stops answering, which the others notice
through the process-group timeout. Nothing of this lives in the library."""
from __future__ import annotations

import os
import signal
import sys
import time

from szo.cli import main
from szo.distributed import get_info
from szo.train.callbacks import Callback


class Fault(Callback):
    def __init__(self, rank: int, step: int, how: str = "kill"):
        self.rank, self.step, self.how = rank, step, how

    def on_step_end(self, step: int, epoch: int, loss: float) -> None:
        if step != self.step or get_info().rank != self.rank:
            return
        if self.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:
            time.sleep(1.0)


def parse(spec: str) -> Fault:
    parts = spec.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("kill", "hang")):
        raise SystemExit(f"fault spec must be RANK:STEP[:kill|hang], got {spec!r}")
    return Fault(int(parts[0]), int(parts[1]), parts[2] if len(parts) == 3 else "kill")


if __name__ == "__main__":
    sys.exit(main(sys.argv[2:], callbacks=[parse(sys.argv[1])]))
