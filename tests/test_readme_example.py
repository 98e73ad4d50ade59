"""README's "Use the optimizer in your own SNN code" is examples/own_loop.py, and it runs as written."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "own_loop.py"


def readme_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Use the optimizer in your own SNN code", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_shows_exactly_the_example_file():
    assert readme_snippet() == EXAMPLE.read_text()


def test_example_runs_as_written_and_learns(tmp_path):
    """A SpikingJelly net that never resets itself, trained by SZO(model, subspace) from the reference."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, str(EXAMPLE)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    acc = float(re.search(r"test accuracy (\d\.\d+)", p.stdout).group(1))
    # measured 0.8741 at the default step (scale-free mu 0.3 / lr 0.03; 0.8841 at the paper's mu 1 / lr 1, the
    # example before issue 52); the same script with start="current" (not at the reference) reached 0.3451
    assert acc > 0.8, p.stdout
    assert (tmp_path / "runs" / "own" / "subspaces").is_dir()
