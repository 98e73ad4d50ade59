"""Frozen BatchNorm running statistics across the perturbed forwards of one step.

Paper Sec. 6 / App. G: "we keep the running statistics of batch norm layers before each
perturbation on training step t the same". What the statistics become after the step is
``bn_update`` (``BN_UPDATES``, an argument of every forward-only optimizer):

* ``"recompute"`` (default): the probes leave the running statistics exactly as they were
  (snapshot / restore below, no commit), and after the update the optimizer runs ONE
  unperturbed train-mode forward of theta_{t+1} on the same batch, which updates them as
  an ordinary training step would. This is the authors' procedure (probes on copies, then
  one forward of the updated model that also gives the logged train accuracy); it costs
  one forward per step, counted in ``forward_passes`` / ``forwards_per_step``. A model with
  no BN layer in train mode costs nothing extra (no forward is run).
* ``"probe-mean"``: free but biased. The running statistics become the mean of what the
  probes produced around theta_t (steps 1-4 below). docs/bn.md measures the bias.

The snapshot / restore machinery (both modes):

1. ``snapshot()`` before the first probe of a step stores every BN layer's
   ``running_mean``, ``running_var`` and ``num_batches_tracked``.
2. Before each probe, ``restore()`` puts those values back, so all 2k (or 2q) perturbed
   forwards see identical running statistics. (In train mode BN normalises with the batch
   statistics anyway; the running statistics are what evaluation later uses.)
3. After each probe, ``accumulate()`` adds the running statistics that probe produced.
4. ``commit()`` at the end of the step sets the running statistics to the *mean over the
   probes* and ``num_batches_tracked`` to snapshot + 1. The probe sums are kept in float64,
   where adding a step's float32 statistics (values of similar magnitude) is exact: the mean
   does not depend on the order of the probes, so a perturbation-parallel run (each rank sums
   its own probes, then the ranks add their sums) ends with the same bits as one process. Because a BN update is affine in
   the batch statistics, this equals one ordinary BN update with the probes' mean batch
   statistics, i.e. to first order in mu the update an unperturbed forward would make,
   without paying for that extra forward.

If the model is in eval mode, or has no BN layers, all of this is a no-op.
``num_batches_tracked`` advances by what one probe advanced it (1, or T for the
per-time-step BN of ``bn_time="per-step"``, ``szo.models``).

The streaming forward (``model.set_streaming(time_chunk=...)``, ``szo.models.streaming``)
also updates the running statistics once per forward, after its last time chunk, for every
``stream_bn`` policy, so this contract holds unchanged with it.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from szo.vocab import BN_UPDATES  # what a forward-only step does to the BN statistics (the module docstring)

from .comm import all_reduce_

__all__ = ["BNStatsFreezer", "bn_layers", "BN_UPDATES", "check_bn_update"]



def check_bn_update(value: object) -> str:
    if value not in BN_UPDATES:
        raise ValueError(f"unknown bn_update {value!r}; valid: {', '.join(BN_UPDATES)} (recompute: one unperturbed "
                         "forward of the updated model sets the BN running statistics; probe-mean: the mean over "
                         "the probes, free but biased)")
    return value  # type: ignore[return-value]


def bn_layers(model: nn.Module) -> list[_BatchNorm]:
    return [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]


class BNStatsFreezer:
    """Keeps BN running statistics identical for every probe of one optimizer step."""

    def __init__(self, model: nn.Module | None):
        self.layers = bn_layers(model) if model is not None else []
        self._saved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._sum: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._count = 0
        self._advance: list[int] = []  # num_batches_tracked advance of one probe, per layer

    @property
    def active(self) -> bool:
        return any(m.training for m in self.layers)

    @torch.no_grad()
    def snapshot(self) -> None:
        self._saved = [
            (m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone()) for m in self.layers
        ]
        self._sum = [(torch.zeros_like(m.running_mean, dtype=torch.float64),
                      torch.zeros_like(m.running_var, dtype=torch.float64)) for m in self.layers]
        self._count = 0
        self._advance = [1] * len(self.layers)

    @torch.no_grad()
    def restore(self) -> None:
        for m, (mean, var, n) in zip(self.layers, self._saved):
            m.running_mean.copy_(mean)
            m.running_var.copy_(var)
            m.num_batches_tracked.copy_(n)

    @torch.no_grad()
    def accumulate(self) -> None:
        for i, (m, (s_mean, s_var), saved) in enumerate(zip(self.layers, self._sum, self._saved)):
            s_mean.add_(m.running_mean)
            s_var.add_(m.running_var)
            if m.training:
                self._advance[i] = int(m.num_batches_tracked - saved[2]) or 1
        self._count += 1

    @torch.no_grad()
    def add_probe_sums(self, sums: dict, count: int, advance: int = 1) -> None:
        """``accumulate()`` for ``count`` probes evaluated elsewhere (``szo.evaluators.batched``, which keeps
        one copy of the statistics per folded probe): ``sums[layer] = (sum over the probes of the
        running_mean, of the running_var)`` that layer produced from the snapshot. A layer not in
        ``sums`` (eval mode) adds ``count`` times its current statistics, as ``accumulate`` would.
        ``advance``: running-statistics updates one probe makes per layer (T for per-step BN)."""
        for m, (s_mean, s_var) in zip(self.layers, self._sum):
            if m in sums:
                s_mean.add_(sums[m][0])
                s_var.add_(sums[m][1])
            else:
                s_mean.add_(m.running_mean, alpha=count)
                s_var.add_(m.running_var, alpha=count)
        self._advance = [advance] * len(self.layers)
        self._count += count

    @torch.no_grad()
    def commit(self, distributed: bool = False, process_group=None) -> int:
        """Running stats := mean over probes (one BN update per step); or the snapshot if no probe ran.

        With ``distributed`` (torch.distributed, ``process_group`` or the default group), the sums and probe counts of all ranks are
        all-reduced first, so every rank ends with the same running statistics. Returns the
        number of bytes this rank sent in that all-reduce (0 without one).
        """
        sent = 0
        count = self._count
        if distributed and self.layers and self.active:
            ref = self._sum[0][0]
            flat = torch.cat([torch.cat([a, b]) for a, b in self._sum]
                             + [torch.tensor([float(count)], dtype=ref.dtype, device=ref.device)])  # float64
            sent = all_reduce_(flat, process_group)  # one message: sums of all layers + probe count
            count = int(flat[-1].item())
            off = 0
            for a, b in self._sum:
                a.copy_(flat[off : off + a.numel()]); off += a.numel()  # noqa: E702
                b.copy_(flat[off : off + b.numel()]); off += b.numel()  # noqa: E702
        if count == 0 or not self.active:
            self.restore()
            return sent
        for m, (s_mean, s_var), (mean0, var0, n), adv in zip(self.layers, self._sum, self._saved, self._advance):
            if not m.training:  # eval mode: a forward leaves its statistics alone; keep them bit-exact
                m.running_mean.copy_(mean0)
                m.running_var.copy_(var0)
                m.num_batches_tracked.copy_(n)
                continue
            m.running_mean.copy_(s_mean / count)
            m.running_var.copy_(s_var / count)
            m.num_batches_tracked.copy_(n + adv)
        return sent
