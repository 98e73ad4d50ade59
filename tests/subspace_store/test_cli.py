"""`subspace build / ls / show / rm` through subspace_store.cli.main."""
from __future__ import annotations

import argparse

import torch
from torch import nn

from subspace_store import SubspaceStore
from subspace_store.cli import main, register
from szo.trajectory import TrajectoryRecorder


def record(path, n: int = 12) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 2))
    rec = TrajectoryRecorder(path, m, model_name="mlp")
    rec.on_train_start()
    g = torch.Generator().manual_seed(1)
    for e in range(1, n):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.1 * e)
        rec.on_epoch_end(e, e)
    return m


def test_build_ls_show_rm(tmp_path, capsys):
    m = record(tmp_path / "traj")
    root = str(tmp_path / "store")
    assert main(["build", "--trajectory", str(tmp_path / "traj"), "--k", "4", "--name", "mlp4",
                 "--window", "2-11", "--reference", "last", "--dtype", "float16", "--root", root, "--quiet"]) == 0
    assert "saved 'mlp4'" in capsys.readouterr().out
    sub = SubspaceStore(root).load("mlp4", model=m)
    assert sub.k == 4 and sub.provenance["N"] == 10 and sub.provenance["epochs"] == list(range(2, 12))
    assert torch.equal(sub.reference, torch.cat([p.detach().reshape(-1) for p in m.parameters()]))

    assert main(["ls", "--root", root]) == 0
    out = capsys.readouterr().out
    assert "mlp4" in out and "float16" in out

    assert main(["show", "mlp4", "--root", root]) == 0
    out = capsys.readouterr().out
    assert "k: 4" in out and "N: 10" in out and "first   1 components" in out and "first   4 components" in out
    entry = sorted(p.name for p in (tmp_path / "store" / "mlp4").iterdir())
    assert entry == ["basis.safetensors", "manifest.json"]  # show never writes into the (checksummed) entry
    assert main(["show", "mlp4", "--root", root, "--plot", str(tmp_path / "ev.png")]) == 0
    assert (tmp_path / "ev.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["show", "mlp4", "--root", root, "--plot", str(tmp_path / "store" / "mlp4" / "ev.png")]) == 2
    assert "inside the store entry" in capsys.readouterr().err

    assert main(["build", "--trajectory", str(tmp_path / "traj"), "--k", "4", "--name", "mlp4",
                 "--root", root, "--quiet"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["build", "--trajectory", str(tmp_path / "traj"), "--k", "40", "--name", "big",
                 "--root", root, "--quiet"]) == 2
    assert "[1, N-1]" in capsys.readouterr().err

    assert main(["rm", "mlp4", "--root", root]) == 0
    assert main(["show", "mlp4", "--root", root]) == 2
    assert "available: (none)" in capsys.readouterr().err


def test_register_into_parent_parser(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="szo")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["subspace", "ls", "--root", str(tmp_path)])
    assert args.func(args) == 0
    assert "no subspaces" in capsys.readouterr().out
