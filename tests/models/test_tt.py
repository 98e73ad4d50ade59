"""TT parameterisation of a model's large layers (szo.models.tt)."""
import pytest
import torch

import szo.models as M
from szo.functional.tt import tt_to_matrix
from szo.models.tt import tt_layers, tt_parametrize


def test_full_rank_tt_keeps_the_function_and_cores_replace_the_weights():
    torch.manual_seed(0)
    model = M.create("spike_convnet", num_classes=10, T=2).double().eval()
    x = torch.randn(4, 1, 8, 8, dtype=torch.float64)
    ref = model(x)
    # full TT rank at every bond: TT-SVD is exact, the outputs do not change
    rep = tt_parametrize(model, [1, 32, 1], min_params=2500)  # fc only (2560 entries), its largest rank
    assert [r["layer"] for r in rep["layers"]] == ["fc"] and rep["layers"][0]["init_rel_error"] < 1e-10
    assert torch.allclose(model(x), ref, atol=1e-10)
    names = [n for n, _ in model.named_parameters()]
    assert "fc.weight" not in names and "fc.parametrizations.weight.original0" in names
    cores = [p for n, p in model.named_parameters() if n.startswith("fc.parametrizations")]
    assert torch.allclose(tt_to_matrix(cores), model.fc.weight, atol=0)


def test_report_counts_d_and_tt_parameters():
    model = M.create("spike_convnet", num_classes=10, T=2)
    d = model.num_params()
    rep = tt_parametrize(model, 4)
    layers = {r["layer"]: r for r in rep["layers"]}
    assert set(layers) == {"conv2", "fc"}
    assert layers["fc"]["tt_params"] == 1 * 5 * 16 * 4 + 4 * 2 * 16 * 1
    assert layers["conv2"]["tt_params"] == 1 * 4 * 12 * 4 + 4 * 4 * 12 * 1
    assert rep["d_dense"] == d
    assert rep["d_tt"] == sum(p.numel() for p in model.parameters()) == d - 2304 - 2560 + 448 + 384
    assert len(tt_layers(model)) == 2


def test_bad_ranks_and_layers_get_one_clear_error_and_leave_the_model_alone():
    model = M.create("spike_convnet", num_classes=10, T=2)
    before = [n for n, _ in model.named_parameters()]
    with pytest.raises(ValueError, match=r"larger than layer 'fc'"):
        tt_parametrize(model, 40)  # conv2 allows 48, fc only 32: nothing is changed
    assert [n for n, _ in model.named_parameters()] == before
    with pytest.raises(ValueError, match="min_params"):
        tt_parametrize(model, 2, min_params=10**6)
    tt_parametrize(model, 2)
    with pytest.raises(ValueError, match="already TT"):
        tt_parametrize(model, 2)
