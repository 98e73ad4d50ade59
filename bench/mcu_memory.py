"""Seed-004 memory: Table 3 (analytic peak training memory) for szo's models, and the integer
learner's own buffers next to the paper's MCU figures.

    python bench/mcu_memory.py                       # digits ConvNet and CIFAR ResNet20, T in {1, 4}
    python bench/mcu_memory.py --models spike_convnet --T 4 --batch 64 --q 4
    python bench/mcu_memory.py --learner             # + szo.hw.optim.mcu.MCUZO's buffers (batch 1, q 100)

Bytes at one byte per value (the paper's int8 MCU setting). Prints markdown tables (bytes / KB).
``--learner`` builds each model's fixed-point network, freezes its int8 weights, runs one MCUZO
step on a random batch of 1 (the paper's MCU batch) to fix the layers' WP/NP modes and reads
``MCUZO.memory_bytes``: trained int8 weights (+16-bit bias mantissas), one layer's int32
gradient buffer, the loss buffer, the seed. Dense = every layer; sparse = the largest of the
paper's four blocks (``split_blocks``), an upper bound for any selected block. The paper's
figures (Sec. 3.4, Fig. 1, MCUNet-in1 at 128x128): 478 KB of int8 parameters + 190 KB peak
inference memory for dense training on a 1024-KB STM32H7B3; 190 KB + 49 KB for sparse training
on a 256-KB STM32F746; quantized BP needs 5.46x the dense BP-free memory.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from szo.hw import to_fixed
from szo.hw.optim.mcu import MCUZO, split_blocks
from szo.hw.reports.memory import TABLE3_ROWS, layer_dims, training_memory
from szo.models import create

INPUTS = {"spike_convnet": (1, 8, 8), "spike_resnet8": (1, 28, 28), "spike_resnet20": (3, 32, 32),
          "spike_vgg11": (3, 32, 32)}
PAPER = ("| MCUNet-in1 (paper, Sec. 3.4) | 1 | 478.0 | 190.0 | / | 668 (1024-KB MCU) | 49 (block) | 239 (256-KB MCU) | "
         "5.46 x dense |")


def table3(models, Ts, batch, q) -> None:
    print("| model | T | L | sum d_w | sum d_a | " + " | ".join(TABLE3_ROWS) + " |")
    print("|" + "---|" * (5 + len(TABLE3_ROWS)))
    for name in models:
        for T in Ts:
            torch.manual_seed(0)
            m = create(name, T=T, in_channels=INPUTS[name][0])
            dims = layer_dims(m, torch.rand(2, *INPUTS[name]))
            mem = training_memory(dims, n=batch, q=q)
            cells = " | ".join(f"{mem[r]:,.0f}" for r in TABLE3_ROWS)
            print(f"| {name} | {T} | {len(dims)} | {sum(d.d_w for d in dims):,} | {sum(d.d_a for d in dims):,} | "
                  f"{cells} |")


def learner(models, T: int, q: int) -> None:
    kb = 1024.0
    print("\n| model | T | int8 params (KB) | peak inference, Table 3 N = 1 (KB) | learner extra, dense (KB) | "
          "dense total (KB) | sparse: block params + extra (KB) | sparse total (KB) | BP, Table 3 N = 1 (KB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in models:
        torch.manual_seed(0)
        m = create(name, T=T, in_channels=INPUTS[name][0]).eval()
        x = torch.rand(1, *INPUTS[name])
        dims = layer_dims(m, x)
        mem = training_memory(dims, n=1, q=q)
        net = to_fixed(m)
        net(x)
        iw = net.freeze_weights()
        y = torch.zeros(1, dtype=torch.long)
        closure = lambda: F.cross_entropy(net(x).mean(0), y, reduction="none")  # noqa: E731
        dense = MCUZO(net, q=1, lr=0.0)
        dense.step(closure)
        d = dense.memory_bytes(1, q=q)
        params = sum(s.w_int.numel() + 2 * (0 if s.bias_mant is None else s.bias_mant.numel()) for s in iw.values())
        extra = d["gradient_buffer"] + d["loss_buffer"] + d["seed"]
        block = max(split_blocks(list(iw), 4), key=lambda b: sum(iw[n].w_int.numel() for n in b))
        sp = MCUZO(net, layers=block, q=1, lr=0.0)
        sp.step(closure)
        s = sp.memory_bytes(1, q=q)
        sparse = s["trained_weights"] + s["gradient_buffer"] + s["loss_buffer"] + s["seed"]
        print(f"| {name} | {T} | {params / kb:.1f} | {mem['inference'] / kb:.1f} | {extra / kb:.1f} | "
              f"{(params + mem['inference'] + extra) / kb:.1f} | {sparse / kb:.1f} ({', '.join(block)}) | "
              f"{(mem['inference'] + sparse) / kb:.1f} | {mem['backprop'] / kb:.1f} |")
    print(PAPER)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["spike_convnet", "spike_resnet20"], choices=sorted(INPUTS))
    p.add_argument("--T", nargs="+", type=int, default=[1, 4])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--q", type=int, default=4, help="probes per layer")
    p.add_argument("--learner", action="store_true", help="also MCUZO's buffers next to the paper's MCU figures "
                   "(batch 1, q 100 as the paper's experiments, the largest T given)")
    a = p.parse_args()
    torch.set_num_threads(1)
    table3(a.models, a.T, a.batch, a.q)
    if a.learner:
        learner(a.models, max(a.T), 100)


if __name__ == "__main__":
    main()
