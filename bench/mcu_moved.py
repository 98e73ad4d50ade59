"""Which int8 values an ``mcu-zo`` run changed: the integers of its checkpoint (optimizer state
``mcu``) against the pretrained model's, frozen as the run froze them (converted with the run's
``hw.weight_bits``, one forward of a training sample for the pooling factors, ``freeze_weights``).

    python bench/mcu_moved.py RUN_DIR [--pretrained RUN_DIR/bptt]

RUN_DIR is a continual ``mcu-zo`` run (e.g. ``szo recipe digits-c-mcu``), whose pretrained model is
the BPTT run in ``RUN_DIR/bptt`` unless given. Prints one line per trained layer.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from szo.build import load_run_model, loaders_for  # noqa: E402
from szo.config import load_recipe  # noqa: E402
from szo.hw import to_fixed  # noqa: E402
from szo.train import checkpoint_path, load_checkpoint  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path)
    p.add_argument("--pretrained", type=Path, default=None)
    a = p.parse_args()
    cfg = load_recipe(a.run / "config.yaml")
    model, _ = load_run_model(a.pretrained or a.run / "bptt")
    net = to_fixed(model.eval(), weight_bits=cfg.hw.weight_bits, arithmetic=cfg.hw.arithmetic, reset=cfg.hw.reset)
    train, _ = loaders_for(cfg, torch.Generator().manual_seed(0))
    with torch.no_grad():
        net(train.dataset[0][0].unsqueeze(0))
    start = net.freeze_weights()
    state = load_checkpoint(checkpoint_path(a.run), map_location="cpu")["optimizer"]["mcu"]
    ints = iter(state["integers"])
    for name in state["paths"]:
        s = start[name]
        w = next(ints)
        line = f"{name}: {int((w != s.w_int).sum())} of {w.numel()} int8 weights changed"
        if s.bias_mant is not None:
            b = next(ints)
            line += f", {int((b != s.bias_mant).sum())} of {b.numel()} bias mantissas"
        print(line)


if __name__ == "__main__":
    main()
