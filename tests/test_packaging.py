"""environment.yml's pip section lists the same dependencies as setup.py."""
import ast
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
# extras installed by `make install` / environment.yml; "cuda" (triton) is GPU-only and left out
ENV_EXTRAS = ("test", "dvs", "corruptions")


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
