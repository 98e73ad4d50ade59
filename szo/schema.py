"""The recipe schema: one frozen dataclass per section of a recipe config, each field's type and
metadata saying what is valid, and the checks a section runs on every value it is built with.

Torch-free: ``import szo.schema`` loads no torch (tests/test_rules.py). The fixed choices come from
``szo.vocab``; a choice a registry holds (model, data set and loss names) names its registry as
``"module:attribute"`` (:data:`REGISTRIES`), imported when a value of that field is checked.

:mod:`szo.config` reads recipes (YAML, ``extends``, ``--set`` overrides) into these sections and
checks the combinations of settings; import the sections from there (``szo.config.RecipeConfig``).
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from szo.recipes import deep_merge
from szo.vocab import (
    ACTIVATIONS,
    BN_TIMES,
    BN_UPDATES,
    ENGINES,
    MEMORY_FORMATS,
    SCALES,
    STREAM_BN_MODES,
    check_float32,
)

Kind = Literal["bp", "subspace", "tta"]
Mode = Literal["scratch", "continual"]
Scheduler = Literal["cosine", "constant"]
Reference = Literal["first", "last"]
Backend = Literal["float", "fixed"]  # = szo.hw.BACKENDS
BNStats = Literal["batch", "deployed"]
Precision = Literal["auto", "fp32", "tf32", "bf16"]  # = szo.precision.PRECISIONS
HWLearner = Literal["float", "integer"]  # szo.optim.SZO on float coordinates | szo.hw.optim.onchip.OnChipSZO
HWArithmetic = Literal["szo", "loihi"]  # = szo.hw.fixed.ARITHMETICS: saturating | bit-exact with Lava's LIF/Dense
HWReset = Literal["subtract", "zero"]  # = szo.hw.neuron.RESETS (null: each LIF's own)
FederatedOptimizer = Literal["sgd", "adam"]  # BAFFLE server update: heavy-ball SGD (Algorithm 1) | Adam (its experiments)
DistMode = Literal["data", "perturbation"]  # = szo.distributed.MODES
TTASetting = Literal["reset", "continual", "both"]
TTAPredict = Literal["before", "after"]
TentOptimizer = Literal["adam", "sgd"]
TTAProtocol = Literal["paper", "train", "loco"]
FederatedSpace = Literal["subspace", "full"]

KINDS: tuple[str, ...] = typing.get_args(Kind)
MODES: tuple[str, ...] = typing.get_args(Mode)
DEVICES: tuple[str, ...] = ("cpu", "cuda")
SCHEDULERS: tuple[str, ...] = typing.get_args(Scheduler)
DIST_MODES: tuple[str, ...] = typing.get_args(DistMode)
TTA_SETTINGS: tuple[str, ...] = ("reset", "continual")
TTA_PREDICT: tuple[str, ...] = typing.get_args(TTAPredict)
TENT_OPTIMIZERS: tuple[str, ...] = typing.get_args(TentOptimizer)
TTA_PROTOCOLS: tuple[str, ...] = typing.get_args(TTAProtocol)
HW_ARITHMETICS: tuple[str, ...] = typing.get_args(HWArithmetic)
HW_RESETS: tuple[str, ...] = typing.get_args(HWReset)
FEDERATED_SPACES: tuple[str, ...] = typing.get_args(FederatedSpace)
FEDERATED_OPTIMIZERS: tuple[str, ...] = typing.get_args(FederatedOptimizer)


def check_threads(value: Any) -> None:
    """The ``threads`` setting (``szo.threads``): ``auto`` or a positive int; one ValueError otherwise."""
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return
    raise ValueError(f"threads must be 'auto' or a positive int (torch's intra-op threads), got {value!r}")


# ----------------------------------------------------------------------------- the schema
def _free() -> dict[str, Any]:
    return {}


def _opt(default: Any = None, **meta: Any) -> Any:
    """A field with validation metadata (``min``, ``max``, ``gt``, ``choices``, ``check``: a
    zero-argument callable giving a validator that raises ValueError, ``free``; ``model``: a setting the
    model takes, not the optimizer, in a section ``szo.options.OptimizerOptions`` derives from)."""
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


_NAMES: dict[type, tuple[str, ...]] = {}  # Section._names per class


class Section(Mapping):
    """A frozen config section that also reads as the mapping it was written as. Constructing one
    checks every value against its field's type and metadata (a section cannot hold an invalid
    value, whoever builds it)."""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            if _section_type(hints[f.name]) is not None or f.metadata.get("free"):
                continue
            meta = {k: v for k, v in f.metadata.items() if k != "required"}
            v = getattr(self, f.name)
            checked = _check_value(f.name, v, hints[f.name], meta)
            if checked is not v:
                object.__setattr__(self, f.name, checked)

    def __getitem__(self, key: str) -> Any:
        if key not in self._names():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    @classmethod
    def _names(cls) -> tuple[str, ...]:
        """The keys in reading order: a section's own keys first, then those of the sections it derives
        from, nearest first (dataclasses put a base's fields first: ``train`` would open with lr)."""
        if cls not in _NAMES:  # read on every item access: computed once per class
            fields = {f.name for f in dataclasses.fields(cls)}
            out: list[str] = []
            for klass in cls.__mro__:
                out += [n for n in inspect.get_annotations(klass) if n in fields and n not in out]
            _NAMES[cls] = tuple(out)
        return _NAMES[cls]

    def __eq__(self, other: object) -> bool:
        """Equal to a section or plain mapping with the same values (a config.yaml read back)."""
        if not isinstance(other, Mapping):
            return NotImplemented
        return self.to_dict() == config_dict(other)

    __hash__ = None  # type: ignore[assignment]  # mutable-looking value semantics, like the dict it was

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dicts / lists (what config.yaml holds)."""
        return {k: (v.to_dict() if isinstance(v, Section) else copy.deepcopy(v)) for k, v in self.items()}

    def replace(self, **changes: Any) -> "Section":
        return dataclasses.replace(self, **changes)

    def select(self, base: type["Section"]) -> dict[str, Any]:
        """The values of the fields this section shares with ``base``, one of the sections it derives
        from (e.g. a stage's ``StepConfig`` keys: lr, momentum, weight_decay)."""
        if not isinstance(self, base):
            raise TypeError(f"{type(self).__name__} does not derive from {base.__name__}")
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(base)}



REGISTRIES: dict[str, str] = {
    "models": "szo.models:check_name",   # a validator: the registered models, or a SpikingJelly network
    "datasets": "szo.data:names",        # the data set registry's names
    "losses": "szo.losses:LOSSES",       # the loss functions by name
}
"""The registries a field's ``choices`` / ``check`` name: what each is, as ``"module:attribute"``.
They hold torch code, so the schema imports one only when it checks a value of that field."""


def _registry(name: str) -> Any:
    """The registry :data:`REGISTRIES` names (its module imported on first use)."""
    module, _, attr = REGISTRIES[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def _datasets() -> list[str]:
    return list(_registry("datasets")())


@dataclass(frozen=True, eq=False)
class ModelConfig(Section):
    # bn_time: BatchNorm over time, "shared" (one normalisation over all T*N samples of a forward,
    # one running-statistics update) or "per-step" (the authors' single-step convention: each
    # time step normalised with its own statistics, T updates per forward); see docs/bn.md.
    # memory_format: activations' layout, auto (channels-last on CPU for the models measured faster
    # so) | channels_last | contiguous; see SpikingModel.set_memory_format, docs/performance.md
    name: str | None = _opt(None, check=lambda: _registry("models"))  # required: see _check_required
    T: int | None = _opt(None, min=1)
    activation: str = _opt("lif", choices=lambda: ACTIVATIONS)
    bn_time: str = _opt("shared", choices=lambda: BN_TIMES)
    memory_format: str = _opt("auto", choices=lambda: MEMORY_FORMATS)
    kwargs: dict = _opt({}, free=True)


@dataclass(frozen=True, eq=False)
class DataConfig(Section):
    name: str | None = _opt(None, choices=_datasets)  # required: see _check_required
    data_dir: str | None = None
    download: bool = False
    augment: bool | None = None
    batch_size: int = _opt(128, min=1)
    test_batch_size: int = _opt(256, min=1)
    num_workers: int = _opt(0, min=0)
    kwargs: dict = _opt({}, free=True)


@dataclass(frozen=True, eq=False)
class LossConfig(Section):
    name: str = _opt("tet", choices=lambda: list(_registry("losses")))
    lamb: float = _opt(0.05, min=0.0, max=1.0)
    phi: float = 1.0


@dataclass(frozen=True, eq=False)
class StepConfig(Section):
    """The update of a stage: SGD's step size, heavy-ball momentum and weight decay (a stage's
    section, and the optimizer's: ``szo.options.OptimizerOptions`` derives from it)."""

    lr: float | None = _opt(0.1, min=0.0)
    momentum: float = _opt(0.9, min=0.0, below=1.0)
    weight_decay: float = _opt(0.0, min=0.0)


@dataclass(frozen=True, eq=False)
class StageConfig(StepConfig):
    """A training stage (``bptt``: the BPTT run that records the trajectory; ``train``: the
    subspace stage, ``lr: null`` = the method's default)."""

    epochs: int = _opt(1, min=1)
    scheduler: Scheduler = "cosine"
    t_max: int | None = _opt(None, min=1)  # cosine period in epochs; null = epochs (set it to stop early on a longer schedule)
    eval_every: int = _opt(1, min=1)
    max_steps_per_epoch: int | None = _opt(None, min=1)
    checkpoint_every_steps: int | None = _opt(None, min=1)


@dataclass(frozen=True, eq=False)
class TrajectoryConfig(Section):
    every: int | str = "epoch"  # "epoch" or a positive number of steps
    record_initial: bool = True


@dataclass(frozen=True, eq=False)
class SubspaceConfig(Section):
    name: str | None = None
    k: int = _opt(20, min=1)
    window: str | list | None = None
    reference: Reference = "first"
    root: str | None = None


DEFAULT_Q: dict[str, int] = {"train": 1, "tta": 10}
"""``szo.q`` (SZO-RGE's directions per step) where none is set, the one home of both defaults: ``train``
for a training stage and every optimizer (``SZO(...)``, ``build_optimizer``: the paper's SZO-RGE(q=1)),
``tta`` for test-time adaptation (App. G's q = 10: a ``kind: tta`` recipe, ``szo adapt``, ``run_tta``)."""


@dataclass(frozen=True, eq=False)
class SZOConfig(Section):
    # time_chunk: forward-only stages run the T steps in chunks of this many (1 = streaming,
    # memory flat in T; null = all T at once); stream_bn: what train-mode BN does in a chunked
    # forward (exact | running | chunk, see szo.models.streaming)
    # engine: how the 2k (2q) probes of an SZO step are evaluated: loop (one forward each) or
    # batched (perturbed copies folded into one forward per chunk of probes, szo.evaluators.batched)
    # bn_update: BN running statistics after a forward-only step: recompute (one unperturbed
    # forward of the updated model, +1 forward per step) | probe-mean (mean over the probes,
    # free, biased); szo.zo.bn and docs/bn.md
    # scale: the units of mu and train.lr / tta.lr_* of the subspace methods (szo.zo.scale, docs/methods.md):
    # absolute (the paper's: lengths in parameter space, App. G mu 1 / lr 1) | trajectory | whitened (mu: the
    # probe's length, lr: the first step's length, in units of the subspace's spread; for the methods whose
    # registry record has relative defaults). null: the method's default (MethodSpec.default_scale: trajectory
    # for those methods with the float learner, absolute for every other; the run records the one it took).
    # mu null: the scale's default (absolute 1.0, App. G; else the method's relative mu, 0.3)
    mu: float | None = _opt(None, gt=0.0)
    scale: str | None = _opt(None, choices=lambda: SCALES)
    # q: directions per step (2q forwards; beyond 1e5 a step never ends); null: the run's default, DEFAULT_Q
    # (1 for a training stage, the paper's SZO-RGE(q=1); 10 for test-time adaptation, App. G)
    q: int | None = _opt(None, min=1, max=100_000)
    coords_per_step: int | None = _opt(None, min=1)
    # refresh (szo-cge / szo-rge / szo-1pt / szo-cge-1pt, float learner): every this many steps the basis is
    # replaced by a fresh Haar-random orthonormal one drawn from the run's generator, re-based at the current
    # point (SubZero's lazy subspace refresh, T0; with szo-rge LOZO's fixed-V / fresh-U sampling; szo.optim.SZO,
    # docs/methods.md "A refreshed random subspace"); null: the stored basis for the whole run
    refresh: int | None = _opt(None, min=1)
    # rank (subzero / lozo / lozo-m): r of each matrix parameter's low-rank perturbation (szo.optim.lowrank);
    # refresh is then SubZero's T0 / LOZO's nu; null: the method's code default (SubZero 8 / 2000, LOZO 2 / 50)
    rank: int | None = _opt(None, min=1)
    time_chunk: int | None = _opt(None, min=1, model=True)
    stream_bn: str = _opt("exact", choices=lambda: STREAM_BN_MODES, model=True)
    engine: str = _opt("loop", choices=lambda: ENGINES)
    chunk: int | None = _opt(None, min=1)
    bn_update: str = _opt("recompute", choices=lambda: BN_UPDATES)
    layers: list | None = None  # np-zo / wp-zo / awp-zo: layers to train (sparse), null = all
    stages: int | None = _opt(None, min=1)  # asyncfgd: pipeline stages K, null = 2
    # np-zo / awp-zo: node perturbation weighs each sample's nodes by its own loss difference (seed 004
    # Algorithm 1) or every node by the batch loss's (szo's earlier form)
    node_losses: Literal["per-sample", "batch-mean"] = "per-sample"


LEARNER_WIDTHS: dict[str, tuple[int, int]] = {"basis_bits": (2, 16), "coord_bits": (8, 48), "ref_bits": (2, 48)}
"""The widths the integer on-chip learner (``szo.hw.optim.onchip.OnChipSZO``) can hold: the basis, the
coordinates and momentum (signed fixed point), theta_ref (a weight mantissa, ``Precision.weight_bits``)."""


def _width(default: int | None, name: str) -> Any:
    lo, hi = LEARNER_WIDTHS[name]
    return _opt(default, min=lo, max=hi)


@dataclass(frozen=True, eq=False)
class IntegerStateConfig(Section):
    """The integer on-chip learner's state widths (``szo.hw.optim.onchip.OnChipSZO``): the quantised basis
    (null: a float basis, for the float learner on the fixed-point forward), the coordinates (with
    ``coord_frac`` fraction bits) and the reference weights. The ``hw`` section's, and the learner's
    options (``szo.options.IntegerLearnerOptions`` derives from it)."""

    basis_bits: int | None = _width(8, "basis_bits")
    coord_bits: int = _width(32, "coord_bits")
    coord_frac: int = _opt(16, min=0)
    ref_bits: int = _width(16, "ref_bits")


@dataclass(frozen=True, eq=False)
class HWConfig(IntegerStateConfig):
    # arithmetic: integer arithmetic of backend fixed (szo: saturating; loihi: bit-exact with
    # Lava's PyLifModelBitAcc/PyDenseModelBitAcc); reset: null keeps each LIF's reset, zero = standard Loihi LIF
    weight_bits: int = _opt(8, min=2, max=16)
    learner: HWLearner = "float"
    arithmetic: HWArithmetic = "szo"
    reset: HWReset | None = None
    # method mcu-zo: seed 004's BP-free block selection (Sec. 3.3.1), a stage before training
    # (szo.prepare.block_selection_stage): the synapses cut into `blocks` contiguous blocks (the paper's
    # 4; fewer when there are fewer layers), each test-trained for `select_epochs` epochs from the same
    # integers on the train split less its last `heldout` fraction, the block with the best held-out
    # accuracy gain then trained alone (sparse); null: no selection (szo.layers, or every layer)
    blocks: int | None = _opt(None, min=1)
    select_epochs: int = _opt(1, min=1)
    heldout: float = _opt(0.1, gt=0.0, below=1.0)


@dataclass(frozen=True, eq=False)
class TTConfig(Section):
    # method tt-zo (szo.models.tt, szo.optim.tt): TT rank(s), cores per weight, which layers (weights
    # with >= min_params entries), the signRGE phase (seed 000: N = 10 directions, mu = 0.1) and the
    # switch to CGE (plateau over `window` steps by less than `tol`, or at switch_step); the CGE
    # phase takes szo.mu / szo.coords_per_step / train.lr / train.momentum
    rank: int | list = 4
    cores: int = _opt(4, min=1)  # seed 000: each weight folded into 4 cores, ranks [1, r, r, r, 1]
    cge: Literal["one-sided", "central"] = "one-sided"  # seed 000 eq. (2): d + 1 forwards; central: 2d
    min_params: int = _opt(1024, min=1)
    sign_lr: float = _opt(1.0e-3, min=0.0)
    sign_q: int = _opt(10, min=1)
    sign_mu: float = _opt(0.1, gt=0.0)
    window: int = _opt(20, min=1)
    tol: float = _opt(0.01, min=0.0)
    switch_step: int | None = _opt(None, min=0)


@dataclass(frozen=True, eq=False)
class DistributedConfig(Section):
    """Multi-process runs (torchrun ... -m szo recipe NAME); ignored by one process."""

    mode: DistMode = "data"
    sync_bn: bool = True
    timeout_s: float = _opt(300.0, gt=0.0)


@dataclass(frozen=True, eq=False)
class FinetuneConfig(Section):
    """How the adaptation subspace is built (``tta.protocol``: what it is fine-tuned on)."""

    trajectory: str | None = None        # existing fine-tuning trajectory (needed for *-c sets without train split)
    corruption: str = "gaussian_noise"   # paper / train: the one corruption fine-tuned on
    severity: int = _opt(1, min=1, max=5)
    images: int | None = _opt(None, min=1)  # first n of the split (loco: in all, across the 14); null = split size
    epochs: int = _opt(10, min=1)
    samples: int = _opt(20, min=1)
    lr: float = _opt(0.01, min=0.0)
    momentum: float = _opt(0.9, min=0.0, below=1.0)
    weight_decay: float = _opt(0.0, min=0.0)
    batch_size: int = _opt(64, min=1)


@dataclass(frozen=True, eq=False)
class AdapterConfig(Section):
    """What every test-time adapter takes besides its subspace and step (``szo.adapt.methods.AdaptOptions``
    derives from it): the subspace methods' momentum, when the batch is predicted, Tent's optimizer."""

    momentum: float = _opt(0.9, min=0.0, below=1.0)
    predict: TTAPredict = "before"
    tent_optimizer: TentOptimizer = "adam"  # Tent's CIFAR setting; sgd (lr 2.5e-4 @ batch 64) for ImageNet
    tent_lr: float = _opt(1.0e-3, gt=0.0)
    tent_momentum: float = _opt(0.9, min=0.0, below=1.0)


@dataclass(frozen=True, eq=False)
class AdaptationConfig(AdapterConfig):
    """How a test-time adaptation run adapts and is evaluated (``szo.adapt.runner.TTAOptions`` derives
    from it): the corrupted test set's severity, batches and location, the subspace methods' learning
    rate per setting."""

    severity: int = _opt(5, min=1, max=5)
    batch_size: int = _opt(100, min=1)  # App. G: 100 for CIFAR-C, 500 for ImageNet-C
    data_dir: str | None = None
    download: bool = False
    corruptions: list | None = None     # null = the 15 in table order
    # the subspace methods' lr per setting; null = the default of szo.scale: absolute 1.0 / 0.1 (App. G),
    # trajectory each method's relative train.lr / a tenth of it (szo.methods)
    lr_reset: float | None = _opt(None, min=0.0)
    lr_continual: float | None = _opt(None, min=0.0)
    max_batches: int | None = _opt(None, min=1)


@dataclass(frozen=True, eq=False)
class TTAConfig(AdaptationConfig):
    """Test-time adaptation (``kind: tta``; paper Sec. 6.3 / App. G)."""

    data: str = _opt("digits-c", choices=_datasets)  # corrupted test set
    kwargs: dict = _opt({}, free=True)  # extra get_dataset keywords of the corrupted set
    source_run: str | None = None      # szo recipe run dir (config.yaml, model.safetensors or last.pt, trajectory/)
    train_source: bool = False         # with source_run null: BPTT-train the source here (digits-size only)
    source_trajectory: str | None = None  # default: <source_run>/trajectory
    n_source: int = _opt(20, min=1)    # last source-trajectory samples in the PCA
    protocol: TTAProtocol = "train"    # fine-tuning data of the subspace: paper (test labels leak) | train | loco
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)


@dataclass(frozen=True, eq=False)
class FederatedConfig(Section):
    """One BAFFLE run (``szo federated``; the recipe gives model, data, loss, subspace, seed)."""

    clients: int = _opt(8, min=1)
    rounds: int = _opt(100, min=1)
    K: int = _opt(20, min=1)            # directions per round (BAFFLE's K); 2K forwards per client per round
    sigma: float = _opt(0.3, gt=0.0)    # perturbation scale (SZO-RGE's mu on digits)
    lr: float = _opt(0.3, min=0.0)
    momentum: float = _opt(0.9, min=0.0, below=1.0)  # server_optimizer sgd: heavy ball
    server_optimizer: FederatedOptimizer = "sgd"  # adam: betas (0.9, 0.99), as the paper's experiments
    ema: float = _opt(0.0, min=0.0, below=1.0)  # > 0: evaluate an EMA of the coordinates (the paper: 0.995)
    alpha: float = _opt(0.5, gt=0.0)    # Dirichlet label skew
    batch_size: int = _opt(64, min=1)   # local batch per round
    space: FederatedSpace = "subspace"  # subspace: directions P z_k; full: z_k in R^d
    secure: bool = True                 # aggregate the uploads through Flower's SecAgg+ (needs >= 2 clients)
    clip_range: float = _opt(16.0, gt=0.0)  # SecAgg+ fixed point: |every uploaded value| <= this, or the client sits the round out
    secagg_threshold: float = _opt(0.75, gt=0.0, max=1.0)  # SecAgg+ reconstruction threshold, a fraction of the clients
    eval_every: int = _opt(10, min=1)
    bn_momentum: float = _opt(0.1, gt=0.0, max=1.0)
    round_timeout_s: float = _opt(600.0, gt=0.0)
    startup_timeout_s: float = _opt(120.0, gt=0.0)  # every client process connected within this, or one line
    max_loss_difference: float = _opt(1.0e3, gt=0.0)  # |aggregated loss difference| beyond it: the round is refused


@dataclass(frozen=True, eq=False)
class LogConfig(Section):
    """Metric sinks besides metrics.jsonl (every run writes that)."""

    tensorboard: bool = False  # TensorBoard event files in RUN_DIR/tensorboard (SummaryWriter)


@dataclass(frozen=True, eq=False)
class RecipeConfig(Section):
    """A resolved recipe: every section, defaults filled in, every value checked."""

    name: str | None = _opt(None, required=True)
    description: str = ""
    kind: Kind = "bp"            # bp: BPTT (+ trajectory + subspace); subspace: train in a subspace; tta
    mode: Mode = "scratch"       # subspace recipes: scratch (reference = first sample) | continual
    # kind subspace: the recipe (shipped name or YAML path) whose BPTT stage pretrains the model and
    # builds subspace.name when the store lacks it, on that recipe's data and loss, with this recipe's
    # model / bptt / trajectory / subspace sections (SOURCE_SECTIONS) -- an adaptation recipe's clean
    # pretraining (digits-c-mcu: digits-continual); null: this recipe's own BPTT stage, on its own data
    source: str | None = None
    method: str = "szo-cge"      # subspace stage optimizer (szo.methods); kind tta: "all" or a comma list
    setting: TTASetting = "both"  # kind tta: reset | continual | both
    seed: int = _opt(0, min=0, max=2 ** 63 - 1)
    device: str = "cpu"
    progress: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    bptt: StageConfig = field(default_factory=lambda: StageConfig(lr=0.1, weight_decay=1.0e-4))
    trajectory: TrajectoryConfig = field(default_factory=TrajectoryConfig)
    subspace: SubspaceConfig = field(default_factory=SubspaceConfig)
    train: StageConfig = field(default_factory=lambda: StageConfig(lr=None, weight_decay=0.0))
    szo: SZOConfig = field(default_factory=SZOConfig)
    # subspace stage only: "fixed" trains through the Loihi-style integer forward (szo.hw);
    # bn_stats "deployed" normalises with the source model's running statistics, frozen
    # (what a chip that folds BN into its weights computes); "batch" is ordinary train-mode BN.
    backend: Backend = "float"
    bn_stats: BNStats = "batch"
    # torch.compile the model's multi-step forward in every stage (BPTT, BP-Subspace, SZO probes):
    # false | true (inductor) | a torch.compile backend name (e.g. aot_eager to debug); see
    # szo.models.compiled. Off by default (no GPU run has checked it yet); on CPU the compile
    # time is repaid after 500-2,500 Spike-ResNet20 but 20,000-60,000 digits forwards (docs/performance.md)
    compile: bool | str = False
    # the arithmetic of every stage (szo.precision): fp32 (IEEE; TF32 off) | tf32 (TF32 convolutions and
    # matmuls on CUDA; fp32 on the CPU) | bf16 (autocast, its weight cache off) | auto (the measured choice per kind of training,
    # szo.precision.AUTO: fp32 for BPTT and for forward-only probes, docs/evidence.md "Precision");
    # PyTorch's own defaults are never used
    precision: Precision = "auto"
    # torch's intra-op CPU threads in every stage (szo.threads): auto (a few forwards timed at 1 ... cores
    # threads when the stage starts; the choice and its timings go into results.json, and a resumed run
    # reuses it) | N. An explicit OMP_NUM_THREADS or torch.set_num_threads in the process wins over auto
    threads: int | str = _opt("auto", check=lambda: check_threads)
    # replay the no-grad forwards (every SZO probe, the BN forward, evaluation) as captured CUDA graphs
    # (szo.models.graphed): same result, fewer kernel launches; CUDA only (CPU forwards stay eager)
    cuda_graphs: bool = False
    hw: HWConfig = field(default_factory=HWConfig)
    tt: TTConfig = field(default_factory=TTConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    tta: TTAConfig = field(default_factory=TTAConfig)
    federated: FederatedConfig = field(default_factory=FederatedConfig)
    log: LogConfig = field(default_factory=LogConfig)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _section_type(hint: Any) -> type[Section] | None:
    return hint if isinstance(hint, type) and issubclass(hint, Section) else None


def check_key(dotted: str, cls: type[Section] = RecipeConfig) -> None:
    """One ValueError if ``dotted`` names no setting of the schema (free-form mappings take any key)."""
    parts = dotted.split(".")
    node: type[Section] | None = cls
    for i, part in enumerate(parts):
        names = node._names() if node is not None else ()
        if part not in names:
            parent = ".".join(parts[:i])
            if node is None:
                raise ValueError(f"unknown key '{dotted}': '{parent}' is a value, not a section")
            where = f"under '{parent}'" if parent else "at the top level"
            raise ValueError(f"unknown key '{dotted}'; valid keys {where}: {', '.join(names)}")
        f = next(f for f in dataclasses.fields(node) if f.name == part)
        if f.metadata.get("free"):
            return
        node = _section_type(_hints(node)[part])


def config_dict(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A config (resolved or raw) as plain nested dicts, deep-copied."""
    if isinstance(cfg, Section):
        return cfg.to_dict()
    return {k: (config_dict(v) if isinstance(v, Mapping) else copy.deepcopy(v)) for k, v in cfg.items()}


# ----------------------------------------------------------------------------- validation
def _type_name(t: Any) -> str:
    return "float" if t is float else t.__name__


def _check_value(key: str, v: Any, hint: Any, meta: Mapping[str, Any]) -> Any:
    """``v`` checked against the field's type and metadata; the value to store (numbers coerced)."""
    args = typing.get_args(hint)
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    options = [a for a in args if a is not type(None)] if union else [hint]
    nullable = union and type(None) in args
    if v is None:
        if nullable and not meta.get("required"):
            return None
        raise ValueError(f"'{key}' must be set (got null)")
    literal = next((o for o in options if typing.get_origin(o) is Literal), None)
    if literal is not None:
        valid = typing.get_args(literal)
        if v not in valid:
            raise ValueError(f"invalid {key} {v!r}; valid: {', '.join(map(str, valid))}")
        return v
    kinds = tuple(typing.get_origin(o) or o for o in options)
    if float in kinds and isinstance(v, str):  # YAML 1.1 reads 1e-4 as a string
        try:
            v = float(v)
        except ValueError:
            raise ValueError(f"'{key}' must be a number, got {v!r}") from None
    if list in kinds and isinstance(v, tuple):  # a sequence given from Python, not YAML
        v = list(v)
    if str in kinds and isinstance(v, os.PathLike):  # a path given from Python
        v = os.fspath(v)
    ok = isinstance(v, kinds) and not (isinstance(v, bool) and bool not in kinds)
    if float in kinds and isinstance(v, int) and not isinstance(v, bool):
        ok, v = True, float(v)
    if not ok:
        want = "/".join(_type_name(k) + ("/int" if k is float else "") for k in kinds)
        raise ValueError(f"'{key}' must be {want}, got {v!r}")
    if "choices" in meta:
        valid = list(meta["choices"]())
        if v not in valid:
            raise ValueError(f"invalid {key} {v!r}; valid: {', '.join(map(str, valid))}")
    if "check" in meta:  # a validator of its own: raises ValueError naming what is valid
        try:
            meta["check"]()(v)
        except ValueError as e:
            raise ValueError(f"invalid {key}: {e}") from None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        _check_range(key, v, meta)
    return v


def _check_range(key: str, v: float, meta: Mapping[str, Any]) -> None:
    lo, hi, gt, below = meta.get("min"), meta.get("max"), meta.get("gt"), meta.get("below")
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError(f"'{key}' must be a finite number, got {v!r}")
    check_float32(key, v)
    if lo is not None and v < lo:
        raise ValueError(f"'{key}' must be >= {lo}, got {v!r}")
    if gt is not None and not v > gt:
        raise ValueError(f"'{key}' must be > {gt}, got {v!r}")
    if hi is not None and v > hi:
        raise ValueError(f"'{key}' must be <= {hi}, got {v!r}")
    if below is not None and not v < below:
        raise ValueError(f"'{key}' must be < {below}, got {v!r}")


def build_section(cls: type[Section], given: Any, prefix: str = "") -> Section:
    """``cls`` from a raw mapping: unknown keys refused, defaults filled, every value checked."""
    if not isinstance(given, Mapping):
        where = prefix.rstrip(".")
        raise ValueError(f"'{where}' must be a section (mapping) with keys {', '.join(cls._names())}, got {given!r}")
    names = cls._names()
    for k in given:
        if k not in names:
            where = f"under '{prefix.rstrip('.')}'" if prefix else "at the top level"
            raise ValueError(f"unknown key '{prefix}{k}'; valid keys {where}: {', '.join(names)}")
    hints, defaults, values = _hints(cls), cls(), {}
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        sub = _section_type(hints[f.name])
        if sub is not None:
            base = getattr(defaults, f.name).to_dict()
            values[f.name] = build_section(sub, deep_merge(base, given.get(f.name) or {}) if isinstance(
                given.get(f.name) or {}, Mapping) else given.get(f.name), key + ".")
        elif f.metadata.get("free"):
            v = given.get(f.name) or {}
            if not isinstance(v, dict):
                raise ValueError(f"'{key}' must be a mapping, got {v!r}")
            values[f.name] = copy.deepcopy(v)
        else:
            values[f.name] = _check_value(key, copy.deepcopy(given.get(f.name, getattr(defaults, f.name))),
                                          hints[f.name], f.metadata)
    return cls(**values)
