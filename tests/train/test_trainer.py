"""Trainer on scikit-learn digits with a tiny spiking ConvNet (seconds per test)."""
import copy
import json

import pytest
import torch
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

from szo.losses import tet_loss
from szo.models import create
from szo.train import Callback, fit, load_checkpoint, read_metrics
from szo.train.checkpoint import checkpoint_path
from szo.zo import StepInfo


def _digits(n_train=192, n_test=96):
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[-n_test:], y[-n_test:])


@pytest.fixture(scope="module")
def data():
    return _digits()


@pytest.fixture(scope="module")
def model0():
    torch.manual_seed(0)  # test-only: a fixed initial model shared by the runs below
    return create("spike_convnet", T=2, width=8)


def _loaders(data, g, bs=32):
    train, test = data
    return (DataLoader(train, batch_size=bs, shuffle=True, generator=g),
            DataLoader(test, batch_size=96, shuffle=False))


class RandomCoordZO(torch.optim.Optimizer):
    """Tiny forward-only optimizer for the tests, written from scratch against the protocol
    (szo.zo.ForwardOnlyOptimizer): central differences on m random coordinates."""

    forward_only = True
    loss_reduction = "mean"  # the closure returns the batch loss
    distributed = None
    bytes_communicated = 0
    train_outputs = True

    def __init__(self, params, lr, generator, m=3, mu=1e-2, momentum=0.5):
        super().__init__(params, dict(lr=lr, momentum=momentum))
        self.generator, self.m, self.mu = generator, m, mu
        self.forward_passes = 0
        self.last_step = None

    @property
    def forwards_per_step(self):
        return 2 * self.m

    @torch.no_grad()
    def step(self, closure, *, batch=None):  # the protocol: the batch is for evaluators that fold over it
        ps = self.param_groups[0]["params"]
        d = sum(p.numel() for p in ps)
        idx = torch.randperm(d, generator=self.generator)[: self.m]
        flat = torch.nn.utils.parameters_to_vector(ps)
        grad = torch.zeros_like(flat)
        losses = []
        for i in idx.tolist():
            vals = []
            for s in (1.0, -1.0):
                v = flat.clone()
                v[i] += s * self.mu
                torch.nn.utils.vector_to_parameters(v, ps)
                loss = closure()
                if loss.requires_grad or torch.is_grad_enabled():
                    raise RuntimeError("forward-only closure must not build a graph")
                self.forward_passes += 1
                vals.append(float(loss))
            grad[i] = (vals[0] - vals[1]) / (2 * self.mu)
            losses += vals
        st = self.state.setdefault(ps[0], {})
        buf = st.get("buf", torch.zeros_like(flat)) * self.param_groups[0]["momentum"] + grad
        st["buf"] = buf
        torch.nn.utils.vector_to_parameters(flat - self.param_groups[0]["lr"] * buf, ps)
        self.last_step = StepInfo(loss=sum(losses) / len(losses), losses=torch.tensor(losses, dtype=torch.float64),
                                  forwards=2 * self.m)
        return torch.tensor(self.last_step.loss)


def test_fit_bp_writes_metrics_results_checkpoint(tmp_path, data, model0):
    model = copy.deepcopy(model0)
    g = torch.Generator().manual_seed(1)
    train, test = _loaders(data, g)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=3)
    s = fit(model, train, test, opt, epochs=3, loss_fn=tet_loss, scheduler=sched, run_dir=tmp_path,
            generator=g, progress=False, info={"method": "bp"})
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["epoch"] for r in recs] == [1, 2, 3]
    assert [r["step"] for r in recs] == [6, 12, 18]
    assert all(r["fp"] == r["bp"] == r["step"] for r in recs)
    assert recs[0]["lr"] == pytest.approx(0.5) and recs[1]["lr"] < 0.5
    assert all(0.0 <= r["test_acc"] <= 1.0 and r["train_time_s"] > 0 for r in recs)
    assert recs[-1]["wall_time_s"] >= recs[-1]["train_time_s"]
    res = json.loads((tmp_path / "results.json").read_text())
    assert res == s
    assert res["best_test_acc"] == max(r["test_acc"] for r in recs)
    assert recs[res["converged_epoch"] - 1]["test_acc"] == res["best_test_acc"]
    assert res["d"] == sum(p.numel() for p in model.parameters()) and res["method"] == "bp"
    assert res["best_test_acc"] > 0.4  # 10 classes: well above chance after 18 BP steps
    assert (tmp_path / "training_curve.png").stat().st_size > 1000
    st = torch.load(checkpoint_path(tmp_path), weights_only=True)
    assert st["epoch"] == 3 and st["in_epoch"] is None
    assert load_checkpoint(checkpoint_path(tmp_path))["step"] == 18
    # an existing run is not silently overwritten
    with pytest.raises(ValueError, match="resume"):
        fit(model, train, test, opt, epochs=3, loss_fn=tet_loss, run_dir=tmp_path, generator=g, progress=False)


def test_fit_forward_only_counts_probes(tmp_path, data, model0):
    model = copy.deepcopy(model0)
    g = torch.Generator().manual_seed(2)
    train, test = _loaders(data, g)
    opt = RandomCoordZO(model.parameters(), lr=0.05, generator=g, m=3)
    s = fit(model, train, test, opt, epochs=2, loss_fn=tet_loss, run_dir=tmp_path, generator=g,
            progress=False, max_steps_per_epoch=2, eval_every=2, plot=False)
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["fp"] for r in recs] == [12, 24] and s["bp"] == 0 and s["fp"] == 24
    assert recs[0]["test_acc"] is None and recs[1]["test_acc"] is not None  # eval_every=2
    assert not (tmp_path / "training_curve.png").exists()


def test_loader_must_use_run_generator(tmp_path, data, model0):
    model = copy.deepcopy(model0)
    train, test = _loaders(data, torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="run generator"):
        fit(model, train, test, opt, epochs=1, loss_fn=tet_loss, run_dir=tmp_path,
            generator=torch.Generator(), progress=False)


class Kill(Callback):
    def __init__(self, at):
        self.at = at

    def on_step_end(self, step, epoch, loss):
        if step == self.at:
            raise KeyboardInterrupt(f"killed at step {step}")


def _run(tmp, data, model0, kind, callbacks=(), resume=False):
    model = copy.deepcopy(model0)
    g = torch.Generator().manual_seed(3)
    train, test = _loaders(data, g)
    if kind == "bp":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    elif kind == "asyncfgd":  # stale pipeline versions and the step index live in its checkpointed state
        from szo.optim import AsyncFGD

        opt = AsyncFGD(model, stages=3, lr=0.01, generator=g)
    else:
        opt = RandomCoordZO(model.parameters(), lr=0.05, generator=g, m=2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=3)
    s = fit(model, train, test, opt, epochs=3, loss_fn=tet_loss, scheduler=sched, run_dir=tmp, generator=g,
            callbacks=callbacks, resume=resume, progress=False, max_steps_per_epoch=4,
            checkpoint_every_steps=3, plot=False)
    return model, s


# 4 steps per epoch, checkpoints every 3 steps and at epoch ends: killed at step 7 the run
# resumes from the mid-epoch checkpoint of step 6, killed at step 9 from the epoch end (step 8)
@pytest.mark.parametrize("kind,kill_at,last_ckpt", [("bp", 7, 6), ("zo", 7, 6), ("zo", 9, 8), ("asyncfgd", 7, 6)])
def test_resume_after_kill_reproduces_uninterrupted_run(tmp_path, data, model0, kind, kill_at, last_ckpt):
    ref_model, ref = _run(tmp_path / "ref", data, model0, kind)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path / "run", data, model0, kind, callbacks=[Kill(kill_at)])
    st = load_checkpoint(checkpoint_path(tmp_path / "run"))
    assert st["step"] == last_ckpt and (st["in_epoch"] is None) == (last_ckpt % 4 == 0)
    model, s = _run(tmp_path / "run", data, model0, kind, resume=True)
    for (n, a), (_, b) in zip(ref_model.state_dict().items(), model.state_dict().items()):
        assert torch.allclose(a.float(), b.float(), atol=1e-6), n
    for key in ("fp", "bp", "steps", "best_test_acc", "final_test_acc", "converged_epoch"):
        assert s[key] == ref[key], key
    a = read_metrics(tmp_path / "ref" / "metrics.jsonl")
    b = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(a) == len(b) == 3
    for ra, rb in zip(a, b):
        for key in ("train_loss", "train_acc", "test_acc", "lr", "fp", "step"):
            assert ra[key] == pytest.approx(rb[key], abs=1e-6), key


def test_half_a_forward_only_optimizer_is_refused(tmp_path, data, model0):
    """An optimizer that says forward_only = True but lacks the protocol is not trained as BP."""
    class Half(torch.optim.SGD):
        forward_only = True

    model = copy.deepcopy(model0)
    g = torch.Generator().manual_seed(2)
    train, test = _loaders(data, g)
    with pytest.raises(ValueError, match="Half says forward_only = True but lacks .*last_step"):
        fit(model, train, test, Half(model.parameters(), lr=0.1), epochs=1, loss_fn=tet_loss, run_dir=tmp_path,
            generator=g, progress=False)


def test_per_sample_optimizer_refuses_a_loss_without_reduction_before_any_forward():
    """An optimizer with loss_reduction 'none' (per-sample node perturbation) needs reduction='none'
    from the loss: a loss without it is one ValueError when the step strategy is built, and a loss
    that raises TypeError itself is not reported as lacking the keyword."""
    from szo.optim import LayerwiseZO
    from szo.train.trainer import StepStrategy

    model = create("spike_convnet", num_classes=10, T=2, width=4)
    opt = LayerwiseZO(model, perturbation="node", q=1)
    with pytest.raises(ValueError, match="must take reduction='none'"):
        StepStrategy(model, opt, lambda out, y: tet_loss(out, y))

    def broken(out, y, reduction="mean"):
        raise TypeError("a bug inside the loss")

    closure = StepStrategy(model, opt, broken).closure(torch.rand(4, 1, 8, 8), torch.tensor([0, 1, 2, 3]), 1.0)
    with pytest.raises(TypeError, match="a bug inside the loss"):
        closure()


def test_log_prefix_marks_every_progress_line(tmp_path, data, model0, capsys):
    """Runs that share a terminal (the demo's worker processes) tell their lines apart by the prefix."""
    model = copy.deepcopy(model0)
    g = torch.Generator().manual_seed(1)
    train, test = _loaders(data, g)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fit(model, train, test, opt, epochs=2, loss_fn=tet_loss, run_dir=tmp_path, generator=g, plot=False,
        log_prefix="[szo-cge] ")
    err = capsys.readouterr()
    epoch_lines = [ln for ln in (err.out + err.err).replace("\r", "\n").splitlines() if "epoch " in ln]
    assert epoch_lines and all(ln.lstrip().startswith("[szo-cge] epoch ") for ln in epoch_lines), epoch_lines
    with pytest.raises(ValueError, match="log_prefix must be a str"):
        fit(model, train, test, opt, epochs=1, loss_fn=tet_loss, run_dir=tmp_path / "b", generator=g, log_prefix=3)
