import json
import subprocess
import sys

from szo.cli import COMMAND_GROUP, build_parser, main


def _one_error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_recipe_list(capsys):
    assert main(["recipe", "--list"]) == 0
    out = capsys.readouterr().out
    assert "digits-bp" in out and "cifar10-scratch" in out


def test_unknown_recipe_one_line(capsys):
    assert main(["recipe", "nope"]) == 2
    line = _one_error_line(capsys)
    assert "unknown recipe 'nope'" in line and "digits-bp" in line and "imagenet-continual" in line


def test_unknown_key_one_line(capsys, tmp_path):
    assert main(["recipe", "digits-bp", "--set", "train.epoch=3", "--out", str(tmp_path)]) == 2
    line = _one_error_line(capsys)
    assert "unknown key 'train.epoch'; valid keys under 'train': epochs, lr" in line


def test_bad_choice_one_line(capsys, tmp_path):
    assert main(["recipe", "digits-scratch", "--set", "method=adam", "--out", str(tmp_path)]) == 2
    assert "valid: bp, bp-subspace, szo-cge, szo-rge, szo-1pt, szo-cge-1pt, zo-cge, zo-rge" in _one_error_line(capsys)


def test_missing_data_dir_clean_error_no_traceback(tmp_path):
    """A real process: one stderr line, exit status 2, no traceback."""
    r = subprocess.run([sys.executable, "-m", "szo", "recipe", "cifar10-bp", "--set", f"data.data_dir={tmp_path}",
                        "--set", f"subspace.root={tmp_path / 'subspaces'}", "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr
    assert str(tmp_path) in lines[0]


def test_subcommands_registered():
    p = build_parser()
    sub = next(a for a in p._actions if a.dest == "command")
    assert {"recipe", "demo", "report", "subspace", "federated", "export", "adapt", "study"} <= set(sub.choices)
    from importlib import metadata  # a plugin package's entry in the group adds its subcommand the same way

    assert "subspace" in {ep.name for ep in metadata.entry_points(group=COMMAND_GROUP)}


def test_report_command(tmp_path, capsys):
    def run(name, label, mode, acc, fp, bp):
        d = tmp_path / name
        d.mkdir()
        hist = [{"epoch": e, "step": 10 * e, "train_loss": 1.0 / e, "test_loss": 1.0 / e, "test_acc": a,
                 "train_time_s": 6.0 * e, "fp": fp * e, "bp": bp * e} for e, a in enumerate(acc, 1)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in hist))
        best = max(range(len(acc)), key=lambda i: acc[i])
        (d / "results.json").write_text(json.dumps({
            "label": label, "mode": mode, "dataset": "digits", "model": "spike_convnet", "d": 5082,
            "best_test_acc": acc[best], "converged_epoch": best + 1, "converged_time_min": 0.1 * (best + 1),
            "converged_fp": fp * (best + 1), "converged_bp": bp * (best + 1)}))

    run("bp", "BP", "bptt", [0.5, 0.9, 0.8], 23, 23)
    run("cge", "SZO-CGE", "scratch", [0.6, 0.95], 920, 0)
    run("cont", "SZO-CGE", "continual", [0.97], 368, 0)
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert "| digits | spike_convnet | 5.1K | 90.00 (n=1) | 95.00 (n=1) |" in out
    assert ("| digits / spike_convnet | SZO-CGE | 1 | 0.10 | 368 | 0 | 97.00 (n=1) | 2 | 0.20 | 1840 | 0 | "
            "95.00 (n=1) |") in out
    assert "| digits / spike_convnet | BP | - | - | - | - | - | 2 | 0.20 | 46 | 46 | 90.00 (n=1) |" in out
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert len(rep["runs"]) == 3 and rep["table1"][0]["SZO-CGE"] == "95.00 (n=1)" and rep["notes"] == []
    assert (tmp_path / "rep" / "accuracy.png").stat().st_size > 1000
    assert main(["report", str(tmp_path / "missing")]) == 2


def test_bad_device_is_validated_like_any_override(capsys, tmp_path):
    # --device used to bypass validation: config.yaml got the bad value, then a raw traceback
    assert main(["recipe", "digits-bp", "--device", "bogus", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: invalid device 'bogus'; valid: cpu, cuda, cuda:N"]
    assert not (tmp_path / "r").exists()
