"""The demo's stages in worker processes (szo.demos.stage_pool): one thread each, the same result as
the stage run alone in this process with one thread, failures raised here."""
import pytest
import torch
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

from szo.demos.stage_pool import default_workers, run_stages
from szo.losses import tet_loss
from szo.models import create
from szo.pipeline import run_demo_digits
from szo.threads import physical_cores
from szo.train import fit, read_metrics


def _stage(run_dir, seed):
    """A small training run (module level: the spawned workers import it); its weights and record."""
    d = load_digits()
    x = torch.tensor(d.images[:96], dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target[:96], dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    train = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, generator=g)
    torch.manual_seed(seed)  # test-only: the initial model
    model = create("spike_convnet", T=2, width=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    s = fit(model, train, None, opt, epochs=2, loss_fn=tet_loss, run_dir=run_dir, generator=g, progress=False,
            plot=False)
    return {"state": model.state_dict(), "loss": read_metrics(run_dir / "metrics.jsonl")[-1]["train_loss"], "threads": s["threads"],
            "process_threads": torch.get_num_threads()}


@pytest.mark.slow  # two spawned processes import torch
def test_stages_in_workers_equal_the_stage_alone(tmp_path):
    torch.set_num_threads(1)  # conftest's count (explicit): the workers get it too
    jobs = [(f"s{i}", _stage, (tmp_path / f"w{i}", i), {}) for i in range(2)]
    ended = []
    got = run_stages(jobs, 2, done=lambda name, r: ended.append(name))
    assert list(got) == ["s0", "s1"] and sorted(ended) == ["s0", "s1"]
    for i in range(2):
        alone = _stage(tmp_path / f"a{i}", i)
        w = got[f"s{i}"]
        assert w["process_threads"] == 1 and w["threads"]["threads"] == 1
        assert w["loss"] == alone["loss"]
        for k, v in alone["state"].items():
            assert torch.equal(w["state"][k], v), k


@pytest.mark.slow  # a spawned process imports torch
def test_a_failing_stage_is_raised_here(tmp_path):
    jobs = [("bad", _stage, (tmp_path / "bad", "not a seed"), {})]
    with pytest.raises(RuntimeError, match="manual_seed"):
        run_stages(jobs, 1)


def test_default_workers():
    assert default_workers(7, "cpu") == min(physical_cores(), 7)
    assert default_workers(1, "cpu") == 1
    assert default_workers(7, "cuda") == 1


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_demo_workers_must_be_positive(tmp_path, bad):
    with pytest.raises(ValueError, match="workers must be a positive int"):
        run_demo_digits(tmp_path, progress=False, workers=bad)


class _Stop(Exception):
    pass


def test_demo_hands_the_pool_its_runs_longest_first(tmp_path, monkeypatch):
    """The demo's seven subspace runs reach the pool in order of their forwards (the three runs at SZO-CGE's
    budget, then SZO-RGE(q=10), SZO-RGE(q=1), the continual run, BP-Subspace), each at the demo's epochs."""
    import szo.pipeline as pipeline

    monkeypatch.setattr(pipeline, "run_recipe", lambda cfg, out, **kw: {"best_test_acc": 0.9, "converged_epoch": 1,
                                                                      "fp": 1, "bp": 1})
    monkeypatch.setattr(pipeline, "subspace_build_stage", lambda *a, **kw: None)
    seen = {}

    def pool(jobs, workers, done=None):
        seen.update(order=[name for name, *_ in jobs], epochs={name: args[0]["train"]["epochs"]
                                                             for name, _, args, _ in jobs}, workers=workers)
        raise _Stop

    monkeypatch.setattr(pipeline, "run_stages", pool)
    with pytest.raises(_Stop):
        run_demo_digits(tmp_path, progress=False, workers=2)
    assert seen["order"] == ["szo-cge", "zo-cge", "zo-cge-ann", "szo-rge-q10", "szo-rge-q1", "continual-szo-cge",
                             "bp-subspace"]
    e = pipeline.DEMO_EPOCHS
    assert seen["epochs"] == {"szo-cge": e, "zo-cge": e, "zo-cge-ann": e, "szo-rge-q10": e, "szo-rge-q1": 60,
                              "continual-szo-cge": 2, "bp-subspace": e}
    assert seen["workers"] == 2
