"""NeuroBench's metrics of a zoo model, checked against counts made independently here."""
import pytest
import torch
from spikingjelly.activation_based import neuron

pytest.importorskip("neurobench")

from szo.hw.reports.hw_report import hw_report, to_markdown  # noqa: E402
from szo.hw.reports.neurobench import StepwiseModel, neurobench_metrics  # noqa: E402
from szo.models import create  # noqa: E402


@pytest.fixture()
def convnet():
    torch.manual_seed(0)
    return create("spike_convnet").eval()


def _x(n=3):
    return torch.rand(n, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 3


def test_stepwise_wrapper_computes_the_multistep_forward(convnet):
    x = _x()
    with torch.no_grad():
        assert torch.equal(StepwiseModel(convnet, convnet.T)(x), convnet(x))


def test_metrics_match_independent_counts(convnet):
    x = _x()
    res = neurobench_metrics(convnet, x)
    spikes = []
    hooks = [m.register_forward_hook(lambda m, i, o: spikes.append(o)) for m in convnet.modules()
             if isinstance(m, neuron.LIFNode)]
    with torch.no_grad():
        convnet(x)
    for h in hooks:
        h.remove()
    ones = sum(int(s.sum()) for s in spikes)
    total = sum(s.numel() for s in spikes)
    assert res["activation_sparsity"] == pytest.approx(1 - ones / total, abs=1e-12)
    # dense synops per sample: every (input, output) pair of conv1, conv2 (3x3, pad 1, 8x8: 484 taps
    # per channel pair) and fc, over T steps
    taps = sum(min(i + 1, 7) - max(i - 1, 0) + 1 for i in range(8)) ** 2
    assert taps == 484
    dense = convnet.T * (16 * 1 * taps + 16 * 16 * taps + 256 * 10)
    assert res["synops_dense"] == dense
    # ACs: conv2 sees sn1's binary spikes: spike count x (output pairs per input position)
    s1 = spikes[0]  # [T, N, 16, 8, 8]
    fan = torch.nn.functional.conv2d(torch.ones(1, 1, 8, 8), torch.ones(1, 1, 3, 3), padding=1)[0, 0]
    acs = float((s1.sum(dim=(0, 1, 2)) * fan).sum()) * 16 / x.shape[0]
    assert res["synops_effective_acs"] == pytest.approx(acs)
    params = sum(p.numel() * 4 for p in convnet.parameters())
    buffers = sum(b.numel() * b.element_size() for b in convnet.buffers())
    assert res["footprint_bytes"] == params + buffers
    assert res["connection_sparsity"] == 0.0


def test_hw_report_shows_neurobench_next_to_szo(convnet):
    rep = hw_report(convnet, batch=2, k=2)
    sec = rep["neurobench"]
    assert set(sec) == {"neurobench", "szo"}
    assert 0 <= sec["szo"]["activation_sparsity"] <= 1
    md = to_markdown(rep)
    assert "## NeuroBench metrics" in md and "| footprint (bytes) |" in md
    assert "neurobench" not in hw_report(convnet, batch=2, k=2, neurobench=False)


def test_bad_input_shape(convnet):
    with pytest.raises(ValueError, match=r"\[N, C, H, W\] or \[T, N, C, H, W\]"):
        neurobench_metrics(convnet, torch.zeros(8, 8))
