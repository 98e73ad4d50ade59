"""environment.yml's pip section lists the same dependencies as setup.py."""
import ast
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
# extras installed by `make install` / environment.yml; "cuda" (triton) is GPU-only and left out
ENV_EXTRAS = ("test", "dvs", "corruptions", "deploy", "federated")


def _setup_lists():
    tree = ast.parse((ROOT / "setup.py").read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("INSTALL_REQUIRES", "EXTRAS_REQUIRE"):
                found[node.targets[0].id] = ast.literal_eval(node.value)
    return found["INSTALL_REQUIRES"], found["EXTRAS_REQUIRE"]


def test_environment_yml_matches_setup_py():
    install, extras = _setup_lists()
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    pip_reqs = [p for p in pip if not p.startswith("-e")]
    expected = list(install) + [r for e in ENV_EXTRAS for r in extras[e]]
    assert sorted(pip_reqs) == sorted(expected)
    assert "-e ." in pip
    assert set(extras) - set(ENV_EXTRAS) == {"cuda"}, "a new extra: add it to environment.yml or ENV_EXTRAS"


def test_makefile_installs_the_same_extras():
    mk = (ROOT / "Makefile").read_text()
    assert f'-e ".[{",".join(ENV_EXTRAS)}]"' in mk


def test_recipes_are_package_data():
    tree = ast.parse((ROOT / "setup.py").read_text())
    kws = {k.arg: k.value for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup"
           for k in n.keywords}
    assert ast.literal_eval(kws["package_dir"]) == {"szo._recipes": "recipes"}
    assert ast.literal_eval(kws["package_data"]) == {"szo._recipes": ["*.yaml"]}
    assert (ROOT / "recipes" / "__init__.py").is_file()
    assert "szo=szo.cli:main" in ast.literal_eval(kws["entry_points"])["console_scripts"]


def test_non_editable_install_finds_the_recipes(tmp_path):
    """Build the wheel from a copy of the sources, install it into a bare folder, list recipes."""
    import shutil
    import subprocess
    import sys

    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "README.md"):
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
    code = ("import szo, szo.config as c; print(szo.__file__); print(' '.join(c.recipe_names())); "
            "print(c.load_recipe('digits-fixed')['backend'])")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "site")}, **run)
    assert p.returncode == 0, p.stderr
    where, names, backend = p.stdout.splitlines()
    assert where.startswith(str(tmp_path / "site"))  # the installed copy, not the source tree
    assert set(names.split()) == {f.stem for f in (ROOT / "recipes").glob("*.yaml")} and backend == "fixed"
