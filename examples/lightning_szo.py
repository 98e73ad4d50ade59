"""SZO inside PyTorch Lightning: a LightningModule trained forward-only, and a resume that continues bit for bit.

    pip install -e ".[lightning]"
    python examples/lightning_szo.py

1. BPTT for a few epochs on sklearn's digits (a SpikingJelly network), recording the weight trajectory,
   and its centered PCA into a k = 3 subspace (as examples/own_loop.py does).
2. A LightningModule trains a fresh network inside that subspace with SZO. The optimizer steps by
   forward passes, calling the closure once per probe under torch.no_grad, so the module uses
   Lightning's *manual* optimization (``self.automatic_optimization = False``; ``training_step`` calls
   ``opt.step(closure)`` with a closure that only computes the loss). Automatic optimization would
   hand SZO Lightning's closure, which runs ``backward``: SZO refuses it in one line that says to set
   ``self.automatic_optimization = False``.
3. The same training stopped after one epoch, saved, and resumed with ``trainer.fit(..., ckpt_path=...)``
   ends with the same weights, bit for bit, as the uninterrupted run. Lightning builds the optimizer
   (``configure_optimizers``: ``SZO(model, subspace)`` moves the weights to the subspace's reference)
   after it has restored the weights and before it restores the optimizer state; SZO's state carries
   the point the weights stand at, and ``load_state_dict`` puts them back there
   (tests/test_lightning_example.py runs this file's functions on CPU).

Lightning calls ``on_before_optimizer_step`` hooks once per closure call, i.e. once per probe here.
The batches come in a fixed order, so a resumed epoch sees the batches of the uninterrupted one.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import lightning as L
import torch
from sklearn.datasets import load_digits
from spikingjelly.activation_based import functional, layer, neuron
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from subspace_store import build_subspace
from szo.optim import SZO
from szo.trajectory import TrajectoryRecorder

T = 4


def make_model() -> nn.Module:
    """A multi-step SpikingJelly network, [T, N, 1, 8, 8] -> [T, N, 10]; its forward does not reset."""
    net = nn.Sequential(layer.Conv2d(1, 8, 3, padding=1, bias=False), layer.BatchNorm2d(8),
                        neuron.LIFNode(tau=2.0), layer.Flatten(), layer.Linear(8 * 8 * 8, 10))
    functional.set_step_mode(net, "m")
    return net


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.mean(0), y)  # the mean over time is the prediction


def digits(n_train: int = 1400) -> tuple[TensorDataset, TensorDataset]:
    """sklearn's 8x8 digits (shipped with sklearn: no download), images in [0, 1]: train and test sets."""
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1).div(16)
    y = torch.tensor(d.target)
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])


def encode(x: torch.Tensor) -> torch.Tensor:
    return x.unsqueeze(0).repeat(T, 1, 1, 1, 1)  # [N, 1, 8, 8] -> [T, N, 1, 8, 8]


def bptt_subspace(train: TensorDataset, out: Path, *, epochs: int = 3, k: int = 3, batch: int = 64, seed: int = 0):
    """Stage 1: BPTT with SGD, one trajectory sample per epoch, and its top-k centered PCA."""
    torch.manual_seed(seed)
    teacher = make_model()
    rec = TrajectoryRecorder(out / "trajectory", teacher)
    rec.on_train_start()
    sgd = torch.optim.SGD(teacher.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(1, epochs + 1):
        for x, y in DataLoader(train, batch_size=batch):
            functional.reset_net(teacher)
            sgd.zero_grad()
            loss_fn(teacher(encode(x)), y).backward()
            sgd.step()
        rec.on_epoch_end(epoch, step=epoch)
    return build_subspace(out / "trajectory", k=k, progress=False)


class SZOModule(L.LightningModule):
    """A SpikingJelly network trained by SZO inside a trajectory subspace (manual optimization)."""

    def __init__(self, subspace, *, mu: float | None = None, lr: float | None = None, estimator: str = "cge", q: int = 1,
                 seed: int = 0, init_seed: int = 1, automatic: bool = False):
        super().__init__()
        torch.manual_seed(init_seed)  # a fresh network: SZO moves it to the subspace's reference
        self.net = make_model()
        self.subspace = subspace
        self.settings = dict(mu=mu, lr=lr, estimator=estimator, q=q)
        self.seed = seed
        # SZO steps by forward passes: training_step calls opt.step(closure) itself
        self.automatic_optimization = automatic

    def configure_optimizers(self):
        # the RGE directions come from this generator; it is part of the optimizer's state_dict
        return SZO(self.net, self.subspace, generator=torch.Generator().manual_seed(self.seed), **self.settings)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.automatic_optimization:  # what Lightning's automatic optimization does with it: refused
            return loss_fn(self.net(encode(x)), y)
        opt = self.optimizers()
        loss = opt.step(lambda: loss_fn(self.net(encode(x)), y))  # forward only: the closure returns the loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @torch.no_grad()
    def accuracy(self, data: TensorDataset) -> float:
        x, y = data.tensors
        self.net.eval()
        functional.reset_net(self.net)
        acc = (self.net(encode(x)).mean(0).argmax(1) == y).float().mean().item()
        functional.reset_net(self.net)
        self.net.train()
        return acc


def trainer(max_epochs: int, root: Path, limit_train_batches: int | float = 1.0) -> L.Trainer:
    return L.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                     limit_train_batches=limit_train_batches)


def fit(subspace, train: TensorDataset, root: Path, *, epochs: int, resume_after: int | None = None,
        batch: int = 64, limit_train_batches: int | float = 1.0, **settings) -> SZOModule:
    """``epochs`` epochs of SZO in Lightning; ``resume_after``: stop after that many, save a checkpoint,
    and finish with a new module and trainer from ``fit(ckpt_path=...)``."""
    loader = DataLoader(train, batch_size=batch)  # a fixed order: a resumed epoch sees the same batches
    module = SZOModule(subspace, **settings)
    if resume_after is None:
        trainer(epochs, root, limit_train_batches).fit(module, loader)
        return module
    first = trainer(resume_after, root, limit_train_batches)
    first.fit(module, loader)
    ckpt = root / "interrupted.ckpt"
    first.save_checkpoint(ckpt)
    # another fresh network: Lightning restores its weights, then SZO's state puts them at the saved point
    resumed = SZOModule(subspace, init_seed=101, **settings)
    # weights_only: the checkpoint is read without unpickling code (SZO's state is tensors, numbers and strings)
    trainer(epochs, root, limit_train_batches).fit(resumed, loader, ckpt_path=ckpt, weights_only=True)
    return resumed


def main() -> None:
    torch.set_num_threads(1)
    train, test = digits()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sub = bptt_subspace(train, root)
        whole = fit(sub, train, root / "whole", epochs=2)
        resumed = fit(sub, train, root / "resumed", epochs=2, resume_after=1)
    same = all(torch.equal(a, b) for a, b in zip(whole.net.state_dict().values(), resumed.net.state_dict().values()))
    print(f"SZO-CGE in Lightning, k = 3, 2 epochs: test accuracy {whole.accuracy(test):.4f}; "
          f"stopped after epoch 1 and resumed from its checkpoint: {'the same' if same else 'DIFFERENT'} weights "
          "bit for bit")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
