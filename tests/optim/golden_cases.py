"""The golden-checkpoint cases: one tiny run per optimizer (method), built only through public API.

``make_golden.py`` ran these with the code of main at commit bb67b48 (before the forward-only
core, issue 22) and committed what ``szo.train.fit`` wrote: ``golden/<case>/last.pt`` (+ its
sha256 record ``last.json``) after 2 steps, and the model state after 4 steps of an
uninterrupted run (``final.safetensors``). ``test_golden.py`` loads the 2-step checkpoints with
today's code, continues them to 4 steps and requires the very same bits; and an uninterrupted
4-step run with today's code must give them too.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

from subspace_store import Subspace
from szo.hw import to_fixed
from szo.hw.optim.onchip import OnChipSZO
from szo.models import create
from szo.models.tt import tt_parametrize
from szo.optim import build_optimizer

GOLDEN = Path(__file__).with_name("golden")
SEED = 7
K = 4
STEPS = 2  # per epoch; the checkpoint is written after epoch 1, the run ends after epoch 2

# case -> (method recorded in the checkpoint, build_optimizer keywords); "onchip-*" build OnChipSZO
CASES: dict[str, tuple[str, dict]] = {
    "bp": ("bp", dict(lr=0.1, momentum=0.9, weight_decay=1e-4)),
    "bp-subspace": ("bp-subspace", dict(lr=0.5)),
    "szo-cge": ("szo-cge", dict(lr=0.5, mu=0.05)),
    "szo-cge-batched": ("szo-cge", dict(lr=0.5, mu=0.05, engine="batched", chunk=3)),
    "szo-rge": ("szo-rge", dict(lr=0.5, mu=0.05, q=2)),
    "szo-rge-probe-mean": ("szo-rge", dict(lr=0.5, mu=0.05, q=2, bn_update="probe-mean")),
    "szo-1pt": ("szo-1pt", dict(lr=0.5, mu=0.05, q=2)),
    "zo-cge": ("zo-cge", dict(lr=0.05, mu=0.01, coords_per_step=3)),
    "zo-rge": ("zo-rge", dict(lr=0.01, mu=0.01, q=2)),
    "fg": ("fg", dict(lr=0.01, q=2)),
    "fg-subspace": ("fg-subspace", dict(lr=0.1, q=2)),
    "tt-zo": ("tt-zo", dict(lr=0.05, mu=0.01, coords_per_step=3,
                             tt=dict(sign_lr=1e-3, sign_q=2, sign_mu=0.1, switch_step=3, cge="central"))),
    "asyncfgd": ("asyncfgd", dict(lr=0.01, momentum=0.0, stages=2)),
    "np-zo": ("np-zo", dict(lr=0.05, mu=0.01, q=2, node_losses="batch-mean")),  # the form the golden file has
    "wp-zo": ("wp-zo", dict(lr=0.05, mu=0.01, q=2)),
    "awp-zo": ("awp-zo", dict(lr=0.05, mu=0.01, q=2, node_losses="batch-mean")),
    "onchip-cge": ("szo-cge", dict(lr=0.5, estimator="cge", rule="momentum", mu_lsb=1 << 11)),
    "onchip-rademacher": ("szo-rge", dict(lr=0.5, estimator="rademacher", rule="momentum", q=2,
                                          mu_lsb=1 << 11)),
    "qzo": ("qzo-subspace", dict(lr=0.5, estimator="rademacher", rule="eq8", q=2, mu_lsb=1 << 11)),
}


def loaders(generator: torch.Generator) -> tuple[DataLoader, DataLoader]:
    """64 train and 32 test images of scikit-learn's digits, [N, 1, 8, 8] in [0, 1]."""
    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(y, dtype=torch.long)
    train = DataLoader(TensorDataset(X[:64], y[:64]), batch_size=16, shuffle=True, generator=generator)
    test = DataLoader(TensorDataset(X[64:96], y[64:96]), batch_size=32)
    return train, test


def model_and_subspace() -> tuple[torch.nn.Module, Subspace]:
    """The tiny model (its initial state from golden/init.safetensors) and the stored K-dim subspace."""
    model = create("spike_convnet", num_classes=10, T=2, width=4)
    model.load_state_dict(load_file(GOLDEN / "init.safetensors"))
    t = load_file(GOLDEN / "subspace.safetensors")
    sub = Subspace(basis=t["basis"], mean=t["mean"], reference=t["reference"], eigenvalues=t["eigenvalues"],
                   explained_variance_ratio=t["explained_variance_ratio"], layout=model.param_layout(),
                   fingerprint=model.fingerprint(), model="spike_convnet", provenance={})
    return model, sub


def build(case: str, model: torch.nn.Module, sub: Subspace, generator: torch.Generator):
    """(network to train, optimizer) of ``case``, as the pipeline would build them."""
    method, kw = CASES[case]
    if case.startswith("onchip") or case == "qzo":
        net = to_fixed(model, weight_bits=8)
        return net, OnChipSZO(net, sub, seed=SEED + 1, basis_bits=8, coord_bits=32, coord_frac=16, ref_bits=16,
                              **kw)
    if method == "tt-zo":
        tt_parametrize(model, 2, cores=2, min_params=100)
    return model, build_optimizer(method, model, subspace=sub, generator=generator, start="current",
                                  **{"scale": "absolute", **kw})  # the goldens were written in the paper's units
