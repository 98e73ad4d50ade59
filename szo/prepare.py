"""What a subspace run trains, prepared apart from the run itself (``szo.stages.subspace_stage``
orchestrates; ``szo.study`` and ``bench/`` prepare the same model outside a run). One function per
concern, each reading the typed config sections (``szo.config``: ``cfg.hw`` is a ``HWConfig``):

* :func:`preflight` -- the recipe's model, built once and checked against the method's options;
* :func:`subspace_model` -- the model at the subspace's reference point (:class:`SubspaceModel`),
  composed of: :func:`load_pretrained` (a continual run's pretrained model, :func:`source_state`) or
  :func:`load_bn_buffers` (``bn_stats: deployed``), :func:`conversion_check` and :func:`fixed_point`
  (``backend: fixed``), :func:`quantize_basis` (``hw.basis_bits``) and ``szo.build.tt_prepare``
  (tensor-train methods: TT preparation has that one home);
* :func:`optimizer_options` -- the ``OptimizerOptions`` the run's optimizer is built with;
* :func:`block_selection_stage` -- seed 004's BP-free choice of the block ``mcu-zo`` trains (``hw.blocks``).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.utils.data import Dataset, Subset

from subspace_store import Subspace
from szo.build import build_model, check_sizes, loss_for, subspace_store_for, tt_prepare
from szo.config import HWConfig, IntegerStateConfig, RecipeConfig, StepConfig
from szo.data import make_loader
from szo.hw import to_fixed
from szo.hw.convert import FixedPointNetwork
from szo.hw.optim.mcu import MCUZO, select_block, split_blocks
from szo.hw.optim.onchip import basis_error, evaluate_fixed, quantized_subspace
from szo.io import atomic_write_json, load_weights
from szo.methods import get_method
from szo.models.base import SpikingModel
from szo.optim import IntegerLearnerOptions, OptimizerOptions
from szo.train import evaluate
from szo.zo import trainable_layers

__all__ = ["subspace_model", "SubspaceModel", "source_state", "load_pretrained", "load_bn_buffers", "conversion_check",
           "fixed_point", "quantize_basis", "optimizer_options", "preflight", "block_selection_stage", "SELECTION_FILE",
           "SelectionBatches"]


def source_state(cfg: RecipeConfig, sub: Subspace) -> dict[str, torch.Tensor]:
    """The pretrained model (parameters + BN buffers) the subspace was built from."""
    src = sub.provenance.get("source_model")
    if not src or not Path(src).is_file():
        need = "continual training" if cfg.mode == "continual" else "bn_stats 'deployed'"
        raise ValueError(f"{need} needs the pretrained model: subspace {cfg.subspace.name!r} "
                         f"has provenance source_model={src!r}, which is not a file")
    return load_weights(src)


def load_pretrained(model: torch.nn.Module, cfg: RecipeConfig, sub: Subspace) -> dict[str, torch.Tensor] | None:
    """The pretrained model (:func:`source_state`) into ``model``: whole for a continual run, only its BN
    buffers for a scratch run with ``bn_stats: deployed`` (:func:`load_bn_buffers`). Returns the state it
    read, None for a run that needs none (scratch, batch statistics)."""
    if cfg.mode != "continual" and cfg.bn_stats != "deployed":
        return None
    state = source_state(cfg, sub)
    if cfg.mode == "continual":
        model.load_state_dict(state)
    else:  # scratch with deployed statistics: only the BN buffers of the pretrained model
        load_bn_buffers(model, state)
    return state


def load_bn_buffers(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """The entries of ``state`` that are not parameters of ``model`` (its BN buffers) into ``model``."""
    names = {n for n, _ in model.named_parameters()}
    model.load_state_dict({n: t for n, t in state.items() if n not in names}, strict=False)


@torch.no_grad()
def conversion_check(model: torch.nn.Module, test_loader, loss_fn: Callable[..., torch.Tensor],
                     hw: HWConfig) -> dict[str, Any]:
    """Test accuracy of the pretrained model with the float and the fixed-point forward (eval-mode BN).

    ``fixed_test_acc`` is the configured ``hw.arithmetic`` / ``hw.reset``; ``arithmetics`` has
    both arithmetics with each LIF's own reset and with the standard Loihi LIF's hard reset.
    """
    _, acc_float = evaluate(model, test_loader, loss_fn)
    runs = {}
    for arithmetic in ("szo", "loihi"):
        for reset in (None, "zero"):
            net = to_fixed(model, weight_bits=hw.weight_bits, arithmetic=arithmetic, reset=reset)
            runs[f"{arithmetic}, reset={reset or 'own'}"] = {
                "test_acc": evaluate_fixed(net, test_loader), "overflows": net.counter.total()}
    if hw.reset == "subtract":  # not among the four above
        net = to_fixed(model, weight_bits=hw.weight_bits, arithmetic=hw.arithmetic, reset="subtract")
        chosen = {"test_acc": evaluate_fixed(net, test_loader), "overflows": net.counter.total()}
    else:
        chosen = runs[f"{hw.arithmetic}, reset={hw.reset or 'own'}"]
    return {"float_test_acc": acc_float, "fixed_test_acc": chosen["test_acc"], "saturations": chosen["overflows"],
            "arithmetic": hw.arithmetic, "reset": hw.reset, "arithmetics": runs}


def fixed_point(model: torch.nn.Module, hw: HWConfig) -> FixedPointNetwork:
    """``model``'s fixed-point twin (``szo.hw.to_fixed``, same parameters) at the hw section's weight
    width, arithmetic and reset."""
    return to_fixed(model, weight_bits=hw.weight_bits, arithmetic=hw.arithmetic, reset=hw.reset)


def quantize_basis(sub: Subspace, hw: HWConfig) -> tuple[Subspace, float | None]:
    """The subspace a fixed-point run trains in, and the basis's relative error at ``hw.basis_bits``: the
    float learner trains in the quantised subspace (``quantized_subspace`` records the error in its
    provenance), the integer learner quantises the basis itself (the subspace stays, the error is
    measured). ``(sub, None)`` with ``basis_bits`` null (a float basis)."""
    if hw.basis_bits is None:
        return sub, None
    if hw.learner == "float":
        sub = quantized_subspace(sub, hw.basis_bits)  # records its error in the provenance
        return sub, sub.provenance["basis_quantization"]["rel_frobenius_error"]
    return sub, basis_error(sub.basis, hw.basis_bits)  # the integer learner quantises the basis itself


@dataclass
class SubspaceModel:
    """What the subspace stage trains: the model (``model``) and the network its probes run
    (``net``: the model itself, or its fixed-point twin), the subspace (quantised for a
    fixed-point float learner), and what results.json records about the preparation."""

    model: torch.nn.Module
    net: torch.nn.Module
    subspace: Subspace
    extra: dict[str, Any] = field(default_factory=dict)


def subspace_model(cfg: RecipeConfig, test_loader: Any = None, model: SpikingModel | None = None) -> SubspaceModel:
    """The model at the subspace's reference point: a continual run loads the pretrained model,
    ``bn_stats: deployed`` its BN buffers (:func:`load_pretrained`); ``backend: fixed`` converts it
    (:func:`fixed_point`, after comparing the pretrained model's float and fixed-point accuracy on
    ``test_loader``: :func:`conversion_check`) and quantises the basis at ``hw.basis_bits``
    (:func:`quantize_basis`); ``tt-zo`` turns its large weights into TT cores (``szo.build.tt_prepare``).
    ``model``: the recipe's model as ``build_model(cfg)`` returns it (``preflight``'s), else built here."""
    model = build_model(cfg) if model is None else model
    sub = subspace_store_for(cfg).load(cfg.subspace.name, model=model)
    extra: dict[str, Any] = {"backend": cfg.backend, "bn_stats": cfg.bn_stats}
    state = load_pretrained(model, cfg, sub)
    if state is not None and cfg.backend == "fixed":
        model.load_state_dict(state)
        extra["conversion"] = conversion_check(model, test_loader, loss_for(cfg), cfg.hw)
    model.load_flat_params(sub.reference)
    net = model
    if cfg.backend == "fixed":
        net = fixed_point(model, cfg.hw)
        extra["hw"] = dict(cfg.hw)
        sub, error = quantize_basis(sub, cfg.hw)
        if error is not None:
            extra["basis_rel_error"] = error
    record = tt_prepare(net, cfg)  # TT-SVD of the start point (tensor-train methods)
    if record is not None:
        extra["tt"] = record
    return SubspaceModel(model, net, sub, extra)


def optimizer_options(cfg: RecipeConfig) -> OptimizerOptions:
    """The :class:`szo.optim.OptimizerOptions` a resolved subspace-recipe config sets: its ``szo``
    section, the update keys of ``train`` (``StepConfig``: lr, momentum, weight_decay), the ``tt``
    section and, for ``hw.learner: integer``, the hw section's state widths with the run's seed. For the
    subspace stage and for tools that build the same optimizer outside a run (``bench/methods.py``).
    OptimizerOptions derives from those sections, so a new SZO hyperparameter is a field of
    ``SZOConfig`` and its use, nothing here (docs/architecture.md, "Adding a hyperparameter")."""
    hw = cfg.hw
    integer = None
    if hw.learner == "integer":  # the on-chip learner's state widths, its XORShift32 seed from the run's
        integer = IntegerLearnerOptions(**{**hw.select(IntegerStateConfig), "basis_bits": hw.basis_bits or 16},
                                        seed=int(cfg.seed) % 0xFFFFFFFF + 1)
    return OptimizerOptions(**cfg.szo, **cfg.train.select(StepConfig), tt=cfg.tt, integer=integer)


def preflight(cfg: RecipeConfig) -> SpikingModel | None:
    """What the config alone cannot tell, checked before the first forward of a run: the subspace
    store root is a directory (or can become one), the model builds from ``model.kwargs`` (once,
    on the CPU), and the subspace stage's method options fit that model and subspace
    (``szo.layers`` names its layers, ``szo.coords_per_step`` <= the coordinates it perturbs).
    Returns the model it built (the recipe's, at its seeded initialisation; None for a TTA recipe
    with a given source) for the first stage to train instead of building it again."""
    if cfg.kind == "tta" and not cfg.tta.train_source:
        return None
    root = subspace_store_for(cfg).root
    for p in (root, *root.parents):
        if p.exists():
            if not p.is_dir():
                raise ValueError(f"subspace.root {root}: {p} is a file, not a directory (the subspace store "
                                 "is a directory of entries); choose another subspace.root")
            break
    check_sizes(cfg)  # T, batch, width, k, chunk against the machine's memory, before anything is allocated
    model = build_model(cfg)
    if cfg.kind != "subspace":
        return model
    sz, spec = cfg.szo, get_method(cfg.method)
    if sz.layers is not None:
        trainable_layers(model, list(sz.layers))  # one line naming the valid layers
    n = sz.coords_per_step
    if n is not None and "coords_per_step" in spec.options:
        d = model.num_params()
        most = min(d, cfg.subspace.k) if spec.subspace else d
        if n > most:
            where = f"the subspace's k = {most}" if spec.subspace else f"the model's d = {d} parameters"
            raise ValueError(f"szo.coords_per_step = {n} is more coordinates than {where}; valid: 1..{most}")
    return model


SELECTION_FILE = "block_selection.json"
"""Where :func:`block_selection_stage` records its choice in the run directory (a resumed run reads it)."""


class SelectionBatches:
    """The block selection's training batches, streamed as the training loop streams its own: ``epochs``
    shuffled passes over ``data`` (full batches), drawn from one generator seeded with ``seed`` each time
    it is iterated, so every block sees the same batches and memory does not grow with ``epochs``
    (materialised, hw.select_epochs = 1e6 once took every epoch's batches before the first step)."""

    def __init__(self, data: Dataset, batch_size: int, epochs: int, seed: int, device: str | torch.device) -> None:
        self.data, self.batch_size, self.epochs, self.seed, self.device = data, batch_size, epochs, seed, device

    def __len__(self) -> int:
        return self.epochs * (len(self.data) // self.batch_size)

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed)
        for _ in range(self.epochs):
            for x, y in make_loader(self.data, self.batch_size, shuffle=True, generator=g, drop_last=True):
                yield x.to(self.device), y.to(self.device)


def block_selection_stage(net: FixedPointNetwork, train_set: Dataset, *, blocks: int, epochs: int, heldout: float,
                          batch_size: int, q: int, lr: float, seed: int, loss_fn: Callable[..., torch.Tensor],
                          device: str | torch.device = "cpu", run_dir: str | os.PathLike | None = None,
                          layers: Sequence[str] | None = None) -> dict[str, Any]:
    """Seed 004 Sec. 3.3.1 as a stage of a run: the network's synapses (``layers``: a subset, in model
    order) cut into ``blocks`` contiguous blocks (:func:`split_blocks`), each test-trained by
    :class:`MCUZO` (``q``, ``lr``: the run's) for ``epochs`` epochs of the train split less its last
    ``heldout`` fraction (batches of ``batch_size``, shuffled by ``seed``; the same batches for every
    block) from the same integers, its gain of accuracy on that held-out part (:func:`select_block`).

    Freezes the network's weights to integers first (a forward of one training sample gives the
    pooling factors) and leaves integers and float parameters as it found them. Returns ``{"block", "layers", "blocks", "gains", "baseline", "forwards",
    "time_s", ...}``; with ``run_dir`` it is written to ``run_dir/block_selection.json`` (atomically)
    and a later call with the same settings reads it instead of selecting again (a resumed run keeps
    its block; other settings: one error).
    """
    if isinstance(heldout, bool) or not 0.0 < heldout < 1.0:
        raise ValueError(f"heldout must be a fraction in (0, 1), got {heldout!r}")
    settings = {"blocks": blocks, "epochs": epochs, "heldout": heldout, "batch_size": batch_size, "q": q,
                "lr": lr, "seed": seed, "layers": None if layers is None else list(layers)}
    path = None if run_dir is None else Path(run_dir) / SELECTION_FILE
    if path is not None and path.is_file():
        done = json.loads(path.read_text(encoding="utf-8"))
        if done.get("settings") != settings:
            raise ValueError(f"{path} records a block selection with settings {done.get('settings')}, this run's are "
                             f"{settings}; remove the file (or the run directory) to select again")
        return done
    n = len(train_set)
    n_held = max(1, int(round(n * heldout)))
    if n - n_held < batch_size:
        raise ValueError(f"block selection: {n - n_held} training samples after holding out {n_held} of {n} "
                         f"({heldout:.0%}) are fewer than one batch of {batch_size}; lower hw.heldout or the batch size")
    fit_set, held_set = Subset(train_set, range(n - n_held)), Subset(train_set, range(n - n_held, n))
    batches = SelectionBatches(fit_set, batch_size, epochs, int(seed), device)
    held = make_loader(held_set, batch_size, shuffle=False)
    if net.int_weights is None:
        if not net.scales_known:
            with torch.no_grad():
                net(fit_set[0][0].unsqueeze(0).to(device))
        net.freeze_weights()
    names = list(trainable_layers(net, layers))
    cut = split_blocks(names, blocks)
    floats = {k: v.clone() for k, v in net.state_dict().items()}
    t = time.perf_counter()
    res = select_block(net, cut, batches, lambda: evaluate(net, held, loss_fn, device)[1], loss_fn,
                       lambda ls: MCUZO(net, layers=ls, q=q, lr=lr, seed=int(seed) % 0xFFFFFFFF + 1))
    # select_block put the integers back; the float parameters too (its write-back left the tried
    # blocks dequantised), so a resumed run, which freezes them again, gets the same integers
    net.load_state_dict(floats)
    res.update(layers=cut[res["block"]], blocks=cut, time_s=time.perf_counter() - t, steps_per_block=len(batches),
               heldout_samples=n_held, settings=settings)
    if path is not None:
        atomic_write_json(path, res)
    return res
