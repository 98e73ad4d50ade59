"""A network szo did not write (SpikingJelly's Fashion-MNIST tutorial CSNN) through szo's public API."""
from __future__ import annotations

import copy

import pytest
import torch
from spikingjelly.activation_based import functional

from szo import models
from szo.losses import rate_mse
from szo.models.foreign import ForeignModel, resolve

NAME = "spikingjelly:conv_fashion_mnist.CSNN"


def csnn(channels=4, T=2, seed=0):
    torch.manual_seed(seed)
    return models.create(NAME, num_classes=10, T=T, channels=channels)


def test_forward_is_the_tutorial_network_run_as_written():
    m = csnn()
    assert isinstance(m, ForeignModel) and type(m.net) is resolve(NAME) and m.net.T == 2
    x = torch.rand(6, 1, 28, 28, generator=torch.Generator().manual_seed(1)) * 3
    ref = copy.deepcopy(m.net)
    out = m(x)
    assert out.shape == (1, 6, 10)
    fr = ref(x)  # the tutorial's own call ...
    functional.reset_net(ref)  # ... and its reset after the batch
    torch.testing.assert_close(out[0], fr, rtol=0, atol=0)
    torch.testing.assert_close(m(x), out, rtol=0, atol=0)  # the neurons were reset in between
    assert all(float(n.v.abs().sum()) == 0.0 if isinstance(n.v, torch.Tensor) else n.v == 0.0
               for n in m.modules() if hasattr(n, "v"))


def test_flat_params_layout_and_fingerprint():
    m = csnn()
    layout = m.param_layout()
    assert layout[0] == ("net.conv_fc.0.weight", (4, 1, 3, 3)) and m.num_params() == sum(
        p.numel() for p in m.parameters())
    v = m.flat_params()
    m.load_flat_params(v * 2)
    torch.testing.assert_close(m.flat_params(), v * 2)
    assert m.fingerprint() == csnn(seed=3).fingerprint() != csnn(channels=5).fingerprint()


def test_public_api_recorder_store_szo_trainer(tmp_path):
    """TrajectoryRecorder -> build_subspace -> SZO(model, subspace) -> fit, as a user would, on the CSNN."""
    from subspace_store import SubspaceStore, build_subspace
    from szo.data import make_loader
    from szo.data.digits import ImageTensorDataset
    from szo.optim import SZO
    from szo.train import TrajectoryCallback, fit
    from szo.trajectory import TrajectoryRecorder

    g = torch.Generator().manual_seed(0)
    x = torch.rand(64, 1, 28, 28, generator=g) * 2
    y = torch.randint(0, 10, (64,), generator=g)
    run_gen = torch.Generator().manual_seed(1)
    loader = make_loader(ImageTensorDataset(x, y), 16, shuffle=True, generator=run_gen)
    m = csnn()
    rec = TrajectoryRecorder(tmp_path / "traj", m, every=1)
    fit(m, loader, None, torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9), epochs=2, loss_fn=rate_mse,
        run_dir=tmp_path / "bp", callbacks=[TrajectoryCallback(rec)], generator=run_gen,
        progress=False, plot=False)
    sub = build_subspace(tmp_path / "traj", 4, progress=False)
    SubspaceStore(tmp_path / "store").save("csnn", sub)
    sub = SubspaceStore(tmp_path / "store").load("csnn", model=m)  # the fingerprint matches the foreign model
    m.train()
    opt = SZO(m, sub, lr=0.5, mu=0.5, scale="absolute")
    bn = [b for b in m.modules() if isinstance(b, torch.nn.modules.batchnorm._BatchNorm)]
    before = [b.running_mean.clone() for b in bn]
    xb, yb = x[:16], y[:16]
    seen = []

    def closure():
        seen.append([b.running_mean.clone() for b in bn])  # the statistics this forward starts from
        return rate_mse(m(xb), yb)

    opt.step(closure)
    assert opt.last_step.forwards == 2 * 4 + 1  # 2k probes + the BN recompute forward
    # BN statistics are frozen across the probes: every probe started from the statistics of before the step
    assert len(seen) == 2 * 4 + 1
    for probe in seen[:-1]:
        for a, b in zip(probe, before):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(m.flat_params(), sub.reference)  # moved within the subspace
    delta = (m.flat_params() - sub.reference).double()
    P = sub.basis.double()
    torch.testing.assert_close(P @ (P.T @ delta), delta, rtol=1e-4, atol=1e-5)


def test_what_a_foreign_network_cannot_do_is_one_line():
    with pytest.raises(ValueError, match="brings its own neurons"):
        models.create(NAME, num_classes=10, T=2, channels=4, activation="relu")
    with pytest.raises(ValueError, match=r"has no argument\(s\) 'width'; its constructor takes: T, channels"):
        models.create(NAME, num_classes=10, T=2, width=4)
    with pytest.raises(ValueError, match="no nn.Module class 'Nope'"):
        models.create("spikingjelly:conv_fashion_mnist.Nope", num_classes=10, T=2)
    with pytest.raises(ValueError, match="no example module"):
        models.check_name("spikingjelly:no_such_example.Net")
    m = csnn()
    with pytest.raises(ValueError, match="memory layout"):
        m.set_memory_format("channels_last")
    with pytest.raises(ValueError, match="compile: false"):
        m.set_compile(True)
    with pytest.raises(ValueError, match="bn_time shared"):
        m.set_bn_time("per-step")
    with pytest.raises(ValueError, match="no time-chunked"):
        m(torch.rand(2, 1, 28, 28), time_chunk=1)
    with pytest.raises(ValueError, match=r"returned \(2, 10\); output='rate' expects \[N, num_classes\] with "
                                         r"num_classes = 7"):
        ForeignModel(m.net, num_classes=7, T=2, model_name=NAME)(torch.rand(2, 1, 28, 28))
