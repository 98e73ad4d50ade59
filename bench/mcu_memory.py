"""Seed-004 Table 3 (analytic peak training memory) for szo's models: ``szo.hw.memory``.

    python bench/mcu_memory.py                       # digits ConvNet and CIFAR ResNet20, T in {1, 4}
    python bench/mcu_memory.py --models spike_convnet --T 4 --batch 64 --q 4

Bytes at one byte per value (the paper's int8 MCU setting). Prints a markdown table (bytes).
"""
from __future__ import annotations

import argparse

import torch

from szo.hw.memory import TABLE3_ROWS, layer_dims, training_memory
from szo.models import create

INPUTS = {"spike_convnet": (1, 8, 8), "spike_resnet20": (3, 32, 32), "spike_vgg11": (3, 32, 32)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["spike_convnet", "spike_resnet20"], choices=sorted(INPUTS))
    p.add_argument("--T", nargs="+", type=int, default=[1, 4])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--q", type=int, default=4, help="probes per layer")
    a = p.parse_args()
    torch.set_num_threads(1)
    print("| model | T | L | sum d_w | sum d_a | " + " | ".join(TABLE3_ROWS) + " |")
    print("|" + "---|" * (5 + len(TABLE3_ROWS)))
    for name in a.models:
        for T in a.T:
            torch.manual_seed(0)
            m = create(name, T=T, in_channels=INPUTS[name][0])
            dims = layer_dims(m, torch.rand(2, *INPUTS[name]))
            mem = training_memory(dims, n=a.batch, q=a.q)
            cells = " | ".join(f"{mem[r]:,.0f}" for r in TABLE3_ROWS)
            print(f"| {name} | {T} | {len(dims)} | {sum(d.d_w for d in dims):,} | {sum(d.d_a for d in dims):,} | "
                  f"{cells} |")


if __name__ == "__main__":
    main()
