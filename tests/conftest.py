"""Shared fixtures."""
import pytest


@pytest.fixture
def figures(monkeypatch):
    """The matplotlib figures ``szo.plots.save_figure`` would write, kept open for inspection
    (legend texts, ticks, positions) instead of being saved; closed after the test."""
    import szo.plots

    got = []

    def keep(fig, path, dpi=110, *, layout=True):
        if layout:
            fig.tight_layout()
        fig.canvas.draw()
        got.append(fig)

    monkeypatch.setattr(szo.plots, "save_figure", keep)
    yield got
    for f in got:
        szo.plots.pyplot().close(f)


# ----------------------------------------------------------------------------- the device switch
def pytest_addoption(parser):
    parser.addoption("--szo-device", default=None,
                     help="device of the tests marked 'device' (cpu | cuda | cuda:N; default $SZO_TEST_DEVICE or cpu)")


def _test_device(config) -> str:
    import os

    return config.getoption("--szo-device") or os.environ.get("SZO_TEST_DEVICE") or "cpu"


def pytest_configure(config):
    """A device asked for and not there stops the session in one line (no silent CPU run).

    One torch thread per test process unless OMP_NUM_THREADS says otherwise: the tests' tensors are
    tiny, so more threads only spin against each other and against the other jobs of a shared
    machine (docs/performance.md, "Threads"); it also makes ``threads: auto`` in the tests' runs see
    an explicit count and not time anything. A test that needs another count sets and restores it."""
    import os

    import torch

    if not os.environ.get("OMP_NUM_THREADS", "").strip():
        torch.set_num_threads(1)
    dev = _test_device(config)
    valid = dev == "cpu" or dev == "cuda" or (dev.startswith("cuda:") and dev[5:].isdigit())
    if not valid:
        raise pytest.UsageError(f"--szo-device / SZO_TEST_DEVICE={dev!r}: valid: cpu, cuda, cuda:N")
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise pytest.UsageError(f"--szo-device / SZO_TEST_DEVICE={dev!r} but torch sees no CUDA device")


@pytest.fixture(scope="session")
def device(request):
    """The device of the 'device' subset (tests/test_device.py): the CPU in CI, a GPU with
    ``SZO_TEST_DEVICE=cuda`` (bench/gpu_suite.sh)."""
    import torch

    return torch.device(_test_device(request.config))
