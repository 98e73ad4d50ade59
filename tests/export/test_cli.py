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


def test_export_and_import_of_the_fmnist_tutorial_csnn(tmp_path, capsys):
    """`szo export` of a run of the fmnist recipes' model (SpikingJelly's tutorial CSNN) was a
    NotImplementedError traceback."""
    import yaml

    cfg = load_recipe("fmnist-bp", ["model.kwargs={channels: 4}"])
    d = tmp_path / "csnn"
    d.mkdir()
    atomic_write_text(d / "config.yaml", yaml.safe_dump(cfg.to_dict()))
    save_file({k: v.contiguous() for k, v in build_model(cfg).state_dict().items()}, d / "model.safetensors")
    out = tmp_path / "csnn.nir"
    assert main(["export", str(d), "--to", "nir", str(out)]) == 0
    text = capsys.readouterr().out
    assert "input [1, 28, 28], T=4" in text and "IF x4" in text
    assert main(["import", str(out)]) == 0
    assert "spikingjelly:conv_fashion_mnist.CSNN, T=4, 10 classes" in capsys.readouterr().out


def test_import_of_a_fixed_graph_with_edited_mantissas_is_one_line(run_dir, tmp_path, capsys):
    from szo.export import read_nir, write_nir

    out = tmp_path / "f.nir"
    assert main(["export", str(run_dir), str(out), "--fixed"]) == 0
    g = read_nir(out)
    g.nodes["fc"].metadata["w_int"][0, 0] += 3
    write_nir(g, out)
    capsys.readouterr()
    assert main(["import", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: NIR node 'fc': its integer weights"), err
