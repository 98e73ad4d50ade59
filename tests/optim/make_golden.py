"""Write the golden checkpoints of test_golden.py (run once, with the code whose state format is the
reference; see golden_cases.py). ``python tests/optim/make_golden.py`` from the project root.

Each case: ``fit`` for 1 epoch of 2 steps (-> golden/<case>/last.pt + last.json), and a separate
uninterrupted 2-epoch run whose final model state is golden/<case>/final.safetensors and final
optimizer state golden/<case>/final_optimizer.pt.
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from szo.losses import tet_loss  # noqa: E402
from szo.models import create  # noqa: E402
from szo.train import fit  # noqa: E402
from tests.optim.golden_cases import CASES, GOLDEN, SEED, STEPS, K, build, loaders, model_and_subspace  # noqa: E402


def run(case: str, run_dir: Path, epochs: int) -> torch.nn.Module:
    """``fit`` of ``case`` for ``epochs`` epochs of STEPS steps into ``run_dir``; the trained network."""
    g = torch.Generator().manual_seed(SEED)
    train, test = loaders(g)
    model, sub = model_and_subspace()
    net, opt = build(case, model, sub, g)
    fit(net, train, test, opt, epochs=epochs, loss_fn=tet_loss, run_dir=run_dir, generator=g, progress=False,
        max_steps_per_epoch=STEPS, plot=False, info={"method": CASES[case][0]})
    return net


def main() -> None:
    GOLDEN.mkdir(exist_ok=True)
    torch.manual_seed(SEED)
    model = create("spike_convnet", num_classes=10, T=2, width=4)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, GOLDEN / "init.safetensors")
    theta = model.flat_params()
    basis, _ = torch.linalg.qr(torch.randn(theta.numel(), K, generator=torch.Generator().manual_seed(SEED)))
    save_file({"basis": basis.contiguous(), "mean": theta.clone(), "reference": theta.clone(),
               "eigenvalues": torch.linspace(1.0, 0.25, K), "explained_variance_ratio": torch.full((K,), 0.25)},
              GOLDEN / "subspace.safetensors")
    for case in CASES:
        out = GOLDEN / case
        out.mkdir(exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            run(case, Path(tmp) / "half", epochs=1)
            for f in ("last.pt", "last.json"):
                shutil.copy(Path(tmp) / "half" / "checkpoints" / f, out / f)
            net = run(case, Path(tmp) / "full", epochs=2)
            save_file({k: v.detach().contiguous() for k, v in net.state_dict().items()}, out / "final.safetensors")
            final = torch.load(Path(tmp) / "full" / "checkpoints" / "last.pt", weights_only=True)
            torch.save(final["optimizer"], out / "final_optimizer.pt")
        print(case, sum(f.stat().st_size for f in out.iterdir()), "bytes")


if __name__ == "__main__":
    main()
