"""``szo export`` / ``szo import`` on a run directory."""
import pytest
from safetensors.torch import save_file

pytest.importorskip("nir")

from szo.cli import main  # noqa: E402
from szo.config import load_recipe  # noqa: E402
from szo.io import atomic_write_text  # noqa: E402
from szo.pipeline import build_model  # noqa: E402


@pytest.fixture()
def run_dir(tmp_path):
    import yaml

    cfg = load_recipe("digits-bp")
    d = tmp_path / "run"
    d.mkdir()
    atomic_write_text(d / "config.yaml", yaml.safe_dump(cfg.to_dict()))
    model = build_model(cfg)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, d / "model.safetensors")
    return d


def test_export_then_import_evaluates_the_same_model(run_dir, tmp_path, capsys):
    out = tmp_path / "m.nir"
    assert main(["export", str(run_dir), "--to", "nir", str(out)]) == 0
    assert out.is_file() and "input [1, 8, 8]" in capsys.readouterr().out
    assert main(["import", str(out), "--data", "digits", "--compare", str(run_dir)]) == 0
    text = capsys.readouterr().out
    assert "T=4, 10 classes" in text and "test accuracy on digits" in text
    assert "max |logit difference| 0," in text and "agree on 100.00%" in text


def test_export_fixed_point(run_dir, tmp_path, capsys):
    out = tmp_path / "f.nir"
    assert main(["export", str(run_dir), str(out), "--fixed"]) == 0
    assert "fixed-point" in capsys.readouterr().out
    assert main(["import", str(out)]) == 0
    assert "fixed-point weights" in capsys.readouterr().out


def test_import_bad_file_is_one_line_error(tmp_path, capsys):
    bad = tmp_path / "bad.nir"
    bad.write_text("hello")
    assert main(["import", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "bad.nir is not a valid NIR file" in err and len(err.strip().splitlines()) == 1
    assert main(["export", "no_such_model", str(tmp_path / "x.nir")]) == 2
    assert "neither a registered model" in capsys.readouterr().err
    assert not (tmp_path / "x.nir").exists()
