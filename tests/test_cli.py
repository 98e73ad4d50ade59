import json
import subprocess
import sys

import pytest

from szo.cli import COMMANDS, build_parser, main


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
    assert "unknown key 'train.epoch'; valid keys under 'train': epochs, scheduler" in line


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
    assert {c.name for c in COMMANDS} <= set(sub.choices)  # szo's own: the table, not packaging metadata


def test_recipe_list_from_a_plain_checkout(tmp_path):
    """``python -m szo recipe --list`` in a copy of the source tree with no installed packaging metadata
    (importlib.metadata finds no entry points): the commands come from szo.cli's table."""
    import os
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for pkg in ("szo", "subspace_store", "recipes"):
        shutil.copytree(root / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import importlib.metadata as m, runpy, sys; m.entry_points = lambda **kw: []; "
            "sys.argv = ['szo', *sys.argv[1:]]; runpy.run_module('szo', run_name='__main__')")
    out = {}
    for args in (("recipe", "--list"), ("--help",)):
        r = subprocess.run([sys.executable, "-c", code, *args], cwd=tmp_path, capture_output=True, text=True,
                           timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path)})
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
        out[args] = r.stdout
    assert "digits-scratch" in out[("recipe", "--list")]
    assert all(c.name in out[("--help",)] for c in COMMANDS)


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


_PLUGINS = {  # entry point -> module source; every one but "good" is broken in its own way
    "boom-import": 'raise RuntimeError("plugin broke on import")\n',
    "boom-register": 'def register(sub):\n    raise RuntimeError("register broke")\n',
    "boom-missing": 'import szo_test_not_installed_pkg\n\ndef register(sub):\n    pass\n',
    "boom-recipe": 'def register(sub):\n    sub.add_parser("recipe", help="hijacked")\n',
    "boom-halfway": 'def register(sub):\n    sub.add_parser("halfway")\n    raise RuntimeError("after one parser")\n',
    "good": 'def register(sub):\n    p = sub.add_parser("plugin-ok", help="a plugin command")\n'
            '    p.set_defaults(func=lambda args: 0)\n',
}


def _plugin_dist(root):
    """A third-party distribution on sys.path with one szo.commands entry point per _PLUGINS case."""
    info = root / "szo_test_plugins-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: szo-test-plugins\nVersion: 0.1\n")
    lines = ["[szo.commands]"]
    for name, src in _PLUGINS.items():
        module = "szo_test_plugin_" + name.replace("-", "_")
        (root / f"{module}.py").write_text(src)
        lines.append(f"{name} = {module}:register")
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return root


def _warnings(err):
    lines = err.strip().splitlines()
    assert all(line.startswith("warning: szo.commands plugin ") for line in lines), lines
    return {line.split("'")[1]: line for line in lines}


def test_broken_plugins_cost_one_warning_line_each(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(_plugin_dist(tmp_path)))
    p = build_parser()
    warned = _warnings(capsys.readouterr().err)
    assert set(warned) == {n for n in _PLUGINS if n != "good"}
    assert "RuntimeError: plugin broke on import" in warned["boom-import"]
    assert "RuntimeError: register broke" in warned["boom-register"]
    assert "No module named 'szo_test_not_installed_pkg'" in warned["boom-missing"]
    assert "conflicting subparser: recipe" in warned["boom-recipe"] and "package szo-test-plugins 0.1" in warned[
        "boom-recipe"]
    sub = next(a for a in p._actions if a.dest == "command")
    assert "plugin-ok" in sub.choices and "halfway" not in sub.choices  # a plugin failing halfway adds nothing
    assert sub.choices["recipe"].get_default("func").__module__ == "szo.cli"  # not the plugin's
    assert main(["recipe", "--list"]) == 0
    out = capsys.readouterr().out
    assert "digits-bp" in out


def test_broken_plugins_never_break_help(tmp_path):
    """A real process: ``szo --help`` exits 0 with the help and one warning line per broken plugin."""
    import os

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(_plugin_dist(tmp_path)), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "szo", "--help"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "plugin-ok" in r.stdout and "recipe" in r.stdout
    assert len(_warnings(r.stderr)) == len(_PLUGINS) - 1


@pytest.mark.parametrize("missing", ["flwr", "nir", "nirtorch", "tonic", "tensorboard", "imagecorruptions"])
def test_every_command_registers_without_an_optional_extra(missing):
    """An optional extra absent (a GPU image without flwr made every `szo` command fail with a
    NameError at import of szo.federated.flower): the CLI still builds, every command listed."""
    code = (f"import sys; sys.modules[{missing!r}] = None\n"
            "from szo.cli import build_parser\n"
            "p = build_parser(); print(sorted(p._subparsers._group_actions[0].choices))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    for cmd in ("recipe", "demo", "study", "federated", "adapt", "export", "hw-report"):
        assert f"'{cmd}'" in out.stdout, (cmd, out.stdout)


def _imported(args):
    """A real ``python -X importtime -m szo ARGS`` process: (exit status, stdout, names of the modules it imported)."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "szo", *args], capture_output=True, text=True,
                       timeout=120)
    lines = [line for line in r.stderr.splitlines() if line.startswith("import time:")]
    assert lines, r.stderr[-2000:]  # -X importtime wrote its table: the check below reads something
    names = {line.rsplit("|", 1)[-1].strip() for line in lines}
    return r.returncode, r.stdout, names


def _torch(names):
    return sorted(n for n in names if n == "torch" or n.startswith("torch."))


def test_help_and_recipe_list_import_no_torch():
    """``szo --help`` and ``szo recipe --list`` build the command line from torch-free modules (each
    command's parser is built only when that command is used): the same help and list as the
    commands' own modules give, without importing torch (issue 31)."""

    from szo.config import load_recipe, recipe_names

    code, out, names = _imported(["--help"])
    assert code == 0 and _torch(names) == [] and "szo.cli" in names and "szo.config" not in names
    listed = {line.split()[0] for line in out.splitlines() if line.startswith("    ") and line.split()}
    assert {c.name for c in COMMANDS} <= listed and {"recipe", "demo", "report"} <= listed

    code, out, names = _imported(["recipe", "--list"])
    assert code == 0 and _torch(names) == [] and "szo.config" not in names
    assert out.splitlines() == [f"{n:<22} {load_recipe(n)['description']}" for n in recipe_names()]


@pytest.mark.parametrize("command", [["recipe"], ["report"], ["demo"], ["demo", "digits"]])
def test_light_commands_help_imports_no_torch(command):
    """The commands whose parsers live in szo.cli print their help without importing torch (the others
    build their parser from modules that need it: docs/performance.md, "Start-up of the szo command")."""
    code, out, names = _imported([*command, "--help"])
    assert code == 0 and out.startswith(f"usage: szo {' '.join(command)}") and _torch(names) == []


def test_a_command_is_built_when_used():
    """An own command's parser gets its arguments the first time it parses or prints its help."""
    p = build_parser()
    sub = next(a for a in p._actions if a.dest == "command")
    assert "--source" in sub.choices["adapt"].format_help()
    args = p.parse_args(["federated", "digits-scratch", "--clients", "4"])
    assert args.clients == 4 and args.func.__module__ == "szo.federated.cli"
    with pytest.raises(SystemExit):
        p.parse_args(["hw-report", "spike_convnet", "--arithmetic", "nope"])


def test_a_closed_pipe_ends_the_listing_quietly():
    """``szo recipe --list | head -1``: the reader leaves after one line; szo exits 0 without a
    BrokenPipeError traceback (Python's documented remedy: stdout to devnull)."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "szo", "recipe", "--list"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.readline()
    p.stdout.close()  # the reader goes away with the rest unread
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 0 and "Traceback" not in err, err


def test_a_command_whose_optional_package_is_missing_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    """A command's arguments live in a module imported when the command is used; if that module
    needs a package that is not installed (flwr for szo federated, say), the command ends in one
    line naming the package (exit 2), not an ImportError traceback."""
    from szo.cli import CommandParser

    (tmp_path / "szo_test_needs_extra.py").write_text("import szo_no_such_package_xyz\n\ndef add(p):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    p = CommandParser(prog="szo federated")
    p.defer("szo_test_needs_extra:add")
    with pytest.raises(SystemExit) as e:
        p.parse_args([])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 2  # usage, then the one error line
    assert "needs the package 'szo_no_such_package_xyz'" in err[1] and "pip install szo_no_such_package_xyz" in err[1]


@pytest.mark.parametrize("error, line", [
    (PermissionError(13, "Permission denied", "/data/x"), "error: Permission denied: /data/x (PermissionError)"),
    (IsADirectoryError(21, "Is a directory", "/data/y"), "error: Is a directory: /data/y (IsADirectoryError)"),
    (OSError(28, "No space left on device"), "error: [Errno 28] No space left on device"),
])
def test_an_operating_system_or_external_failure_is_one_line_with_status_5(monkeypatch, capsys, error, line):
    """What the operating system refuses, or a process szo drives that fails (szo.exits.ExternalError), is
    one line and exit status 5, not a traceback; a missing file stays status 2 (bad input)."""
    import szo.commands.report as report
    from szo.exits import ExternalError

    def raise_(e):
        def run(args):
            raise e
        return run

    for e, want, code in ((error, line, 5),
                          (ExternalError("the Lava runner was killed by signal SIGKILL"),
                           "error: the Lava runner was killed by signal SIGKILL", 5),
                          (FileNotFoundError(2, "No such file or directory", "/nope"),
                           "error: [Errno 2] No such file or directory: '/nope'", 2)):
        monkeypatch.setattr(report, "run", raise_(e))
        assert main(["report", "somewhere"]) == code
        assert capsys.readouterr().err.strip().splitlines() == [want]


def test_an_interrupted_command_says_resume_only_where_it_has_it(monkeypatch, capsys):
    """Ctrl-C: 'rerun with --resume' only for a command that has --resume (szo recipe does, szo report not)."""
    import szo.commands.report as report

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "run", interrupted)
    assert main(["report", "somewhere"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"
