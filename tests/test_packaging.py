"""pyproject.toml is the one source: dependencies, extras, commands (entry points), package data,
the package list; environment.yml and the Makefile install from it; a wheel built from it works."""
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml
from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# extras installed by `make install` / environment.yml; "cuda" (triton) is GPU-only and left out
ENV_EXTRAS = ("test", "dvs", "corruptions", "deploy", "federated", "log", "lightning")


def test_environment_yml_and_makefile_install_from_pyproject():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    spec = f'-e ".[{",".join(ENV_EXTRAS)}]"'
    assert pip == [spec.replace('"', "")] or pip == [spec]  # no copy of the requirements: pyproject's
    assert spec in (ROOT / "Makefile").read_text()
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert set(extras) - set(ENV_EXTRAS) == {"cuda"}, "a new extra: add it to environment.yml / Makefile"
    assert not (ROOT / "setup.py").exists()


def test_upper_bounds_where_an_api_is_known_to_break():
    deps = PYPROJECT["project"]["dependencies"] + [d for e in PYPROJECT["project"]["optional-dependencies"].values()
                                                   for d in e]
    bounded = {d.split(">")[0].split("[")[0] for d in deps if "<" in d}
    assert {"spikingjelly", "flwr", "nir"} <= bounded


def test_requires_python_admits_no_python_a_dependency_refuses():
    """Issue 49: ``requires-python >=3.10`` while spikingjelly 2.0 and flwr 1.42 need 3.11: on 3.10 the
    install failed inside the resolver. The lower bound is at least every installed dependency's own
    (``Requires-Python`` of its metadata), and ruff's target is that version (the Lava runner excepted:
    a script for Lava's own 3.10 interpreter, which installs lava-nc only)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    ours = SpecifierSet(PYPROJECT["project"]["requires-python"])
    lowest = min(s.version for s in ours if s.operator == ">=")
    deps = PYPROJECT["project"]["dependencies"] + PYPROJECT["project"]["optional-dependencies"]["federated"]
    checked = []
    for d in deps:
        name = Requirement(d).name
        try:
            theirs = md.metadata(name)["Requires-Python"]
        except md.PackageNotFoundError:
            continue
        if theirs:
            assert lowest in SpecifierSet(theirs), f"{name} needs Python {theirs}; requires-python says {ours}"
            checked.append(name)
    assert {"spikingjelly", "flwr"} <= set(checked)
    assert PYPROJECT["tool"]["ruff"]["target-version"] == "py" + lowest.replace(".", "")
    assert PYPROJECT["tool"]["ruff"]["per-file-target-version"] == {"szo/hw/lava/runner.py": "py310"}


def test_package_list_is_the_package_tree():
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found = set(find_packages(where=str(ROOT), include=["szo", "szo.*", "subspace_store", "subspace_store.*"]))
    assert listed == found | {"szo._recipes"}, f"pyproject.toml's packages differ from the tree: {listed ^ found}"
    assert PYPROJECT["tool"]["setuptools"]["package-dir"] == {"szo._recipes": "recipes"}
    assert PYPROJECT["tool"]["setuptools"]["package-data"]["szo._recipes"] == ["*.yaml"]
    assert (ROOT / "recipes" / "__init__.py").is_file() and (ROOT / "szo" / "py.typed").is_file()


def test_builtin_commands_come_from_the_table_not_entry_points():
    """szo's own commands are szo.cli's table (a plain checkout runs them); the packaging metadata
    declares only the console script, and the entry-point groups are left to plugins."""
    from szo.cli import COMMANDS, DEMOS, load

    assert PYPROJECT["project"]["scripts"]["szo"] == "szo.cli:main"
    assert "entry-points" not in PYPROJECT["project"]
    for command in (*COMMANDS, *DEMOS):
        assert callable(load(command.build)), command


def test_non_editable_install_finds_the_recipes_and_commands(tmp_path):
    """Build the wheel from a copy of the sources, install it into a bare folder, list recipes and commands."""
    import shutil

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in ("szo", "subspace_store", "recipes"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    run = dict(capture_output=True, text=True, timeout=300)
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path / "dist"), str(src)], **run)
    assert p.returncode == 0, p.stderr
    wheel = next((tmp_path / "dist").glob("szo-*.whl"))
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                        "--target", str(tmp_path / "site"), str(wheel)], **run)
    assert p.returncode == 0, p.stderr
    code = ("import szo, szo.config as c; print(szo.__file__); "
            "print(' '.join(c.recipe_names())); print(c.load_recipe('digits-fixed')['backend']); "
            "from szo.cli import build_parser; p = build_parser(); "
            "print(' '.join(sorted(p._subparsers._group_actions[0].choices)))")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "site")}, **run)
    assert p.returncode == 0, p.stderr
    where, names, backend, commands = p.stdout.splitlines()
    assert where.startswith(str(tmp_path / "site"))  # the installed copy, not the source tree
    assert set(names.split()) == {f.stem for f in (ROOT / "recipes").glob("*.yaml")} and backend == "fixed"
    from szo.cli import COMMANDS

    assert {c.name for c in COMMANDS} | {"recipe", "demo", "report"} <= set(commands.split())
    assert (tmp_path / "site" / "szo" / "py.typed").is_file()


def test_ruff_is_clean():
    """The lint step of `make test`, also here so that a bare pytest run sees it."""
    p = subprocess.run([sys.executable, "-m", "ruff", "check", "szo", "subspace_store", "tests", "bench", "examples"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
