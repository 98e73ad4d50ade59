"""BAFFLE on Flower end to end: a server and 2 client processes over loopback gRPC, 2 rounds (one test: startup is slow)."""
import json

import pytest

pytestmark = pytest.mark.slow  # a Flower server and client processes

pytest.importorskip("flwr")


def test_two_clients_two_rounds_over_loopback(tmp_path):
    import torch

    from szo.config import load_recipe
    from szo.federated.flower import FederatedConfig, run_federated

    threads = torch.get_num_threads()

    cfg = load_recipe("digits-scratch", ["progress=false", "model.kwargs={width: 4}", "bptt.epochs=1",
                                         "subspace.k=2", f"subspace.root={tmp_path / 'store'}"])
    fc = FederatedConfig(clients=2, rounds=2, K=3, eval_every=1, batch_size=16)
    s = run_federated(cfg, tmp_path / "run", fc)
    # the server ran with one thread but gave the caller's back (it used to leave 1 set, which
    # made a later in-process float32 reference differ from 2-thread worker processes)
    assert torch.get_num_threads() == threads
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and all("test_acc" in r for r in rows)
    assert s["fp"] == 2 * 2 * 3 * 2 and s["bp"] == 0 and s["dim"] == 2
    assert sum(s["client_sizes"]) == 1437  # the digits train split, partitioned
    # down: 2 float32 coordinates + seed/config per client; up: K=3 words + BN statistics (2 layers x 2 x 4 ch)
    assert 0 < s["bytes_down_per_round"] < 2 * 600 and 0 < s["bytes_up_per_client_round"] < 600
    assert s["bytes_up_per_client_round"] < 4 * s["d"]  # far below uploading a gradient
    assert json.loads((tmp_path / "run" / "results.json").read_text())["rounds"] == 2
