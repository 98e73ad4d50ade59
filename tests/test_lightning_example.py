"""examples/lightning_szo.py: SZO in a LightningModule (manual optimization) resumes exactly, and
automatic optimization is refused in one line that says what to do (issue 40). CPU, offline, tiny."""
from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("lightning_szo", ROOT / "examples" / "lightning_szo.py")
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)

BATCHES = 4  # per epoch: 4 batches of 32 digits


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    train, _ = example.digits(n_train=128)
    return train, example.bptt_subspace(train, tmp_path_factory.mktemp("bptt"), epochs=3, batch=32)


def _fit(data, root, **kw):
    train, sub = data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers, loggers and tips
        return example.fit(sub, train, root, batch=32, limit_train_batches=BATCHES, **kw)


@pytest.mark.parametrize("estimator", ["cge", "rge"])
def test_fit_from_a_checkpoint_continues_like_the_uninterrupted_run(data, tmp_path, estimator):
    """Lightning restores the weights, builds SZO (which moves them to the reference), then loads the
    optimizer state: after 3 epochs the resumed run has the uninterrupted run's weights, BN statistics
    and RGE generator, bit for bit."""
    settings = dict(estimator=estimator, q=2, mu=0.5, lr=0.5)
    whole = _fit(data, tmp_path / "whole", epochs=3, **settings)
    resumed = _fit(data, tmp_path / "resumed", epochs=3, resume_after=1, **settings)
    sub = data[1]
    a, b = whole.net.state_dict(), resumed.net.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    assert not torch.equal(torch.nn.utils.parameters_to_vector(whole.net.parameters()), sub.reference)  # it trained
    opt_a, opt_b = whole.trainer.optimizers[0], resumed.trainer.optimizers[0]
    assert opt_a.forward_passes == opt_b.forward_passes == 3 * BATCHES * opt_a.forwards_per_step
    assert torch.equal(opt_a.generator.get_state(), opt_b.generator.get_state())
    assert torch.equal(opt_a.coordinates, opt_b.coordinates)


def test_automatic_optimization_is_refused_in_one_line(data, tmp_path):
    """Lightning's automatic optimization hands the optimizer a closure that runs zero_grad and backward."""
    with pytest.raises(ValueError) as e:
        _fit(data, tmp_path, epochs=1, automatic=True)
    msg = str(e.value)
    assert "\n" not in msg and "SZO.step is forward-only" in msg and "self.automatic_optimization = False" in msg
