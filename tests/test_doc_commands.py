"""Every ``szo recipe NAME [--set KEY=VALUE ...]`` command printed in README.md and docs/*.md validates
through the path ``szo recipe`` takes: szo's own argument parser, then ``load_recipe`` (the recipe's
``extends`` chain and ``method_defaults``, the overrides, ``validate``, ``resolve``). A renamed key or recipe,
a removed choice, or a default that makes a printed setting invalid (a relative ``szo.scale`` where it does
not apply) fails here, not in a reader's terminal.

Commands are taken from fenced and indented code blocks (``\\`` continuations joined, ``# comments`` cut) and
from inline code spans (also across a line break); ``python -m szo`` and ``torchrun ... -m szo`` count.
An optional part ``[--set ...]`` is checked left out and put in (``[a | b]``: each alternative). A command
with a placeholder in its recipe or settings (an upper-case word such as ``M``, ``LR``, ``STORE``, or ``...``)
is a template and is left out, as are a run's own ``config.yaml`` and ``szo recipe --list``.
"""
from __future__ import annotations

import contextlib
import io
import itertools
import re
import shlex
from pathlib import Path

import pytest

from szo.cli import build_parser
from szo.commands.recipe import recipe_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_COMMAND = re.compile(r"(?<![\w.\-/])szo\s+recipe\b")
_PLACEHOLDER = re.compile(r"\b[A-Z][A-Z0-9_]*\b|\.\.\.|…")
_CODE_START = re.compile(r"(szo|python|OMP_NUM_THREADS=|torchrun)\b")


def _commands_in(text: str, first_line: int, code: bool) -> list[tuple[int, str]]:
    out = []
    for m in _COMMAND.finditer(text):
        rest = text[m.start():]
        if code:  # a code line ends at a comment, a second command or a redirection
            rest = re.split(r"\s#|;|&&|\s\d?>", rest.split("\n", 1)[0])[0]
        out.append((first_line + text[:m.start()].count("\n"), " ".join(rest.split())))
    return out


def extract(text: str) -> list[tuple[int, str]]:
    """(line, command) of every ``szo recipe`` command printed in markdown ``text``."""
    lines = text.splitlines()
    found: list[tuple[int, str]] = []
    para: list[tuple[int, str]] = []

    def flush() -> None:
        if para:
            joined = "\n".join(t for _, t in para)
            for span in re.finditer(r"`([^`]+)`", joined):
                found.extend(_commands_in(span.group(1), para[0][0] + joined[:span.start()].count("\n"), code=False))
            para.clear()

    fenced, i = False, 0
    while i < len(lines):
        line = lines[i]
        if line.strip().startswith("```"):
            flush()
            fenced, i = not fenced, i + 1
            continue
        if fenced or (line.startswith("    ") and _CODE_START.match(line.strip())):
            flush()
            j, joined = i, line
            while joined.rstrip().endswith("\\") and j + 1 < len(lines):
                j += 1
                joined = joined.rstrip()[:-1] + " " + lines[j].strip()
            found.extend(_commands_in(joined, i + 1, code=True))
            i = j + 1
            continue
        if not line.strip() or line.lstrip().startswith("|"):  # a paragraph ends; a table row is its own
            flush()
            if line.strip():
                para.append((i + 1, line))
                flush()
        else:
            para.append((i + 1, line))
        i += 1
    flush()
    return found


def variants(cmd: str) -> list[str]:
    """``cmd`` with each optional ``[--...]`` part left out and put in (``[a | b]``: each alternative)."""
    groups, pos = [], 0
    while (m := re.search(r"\[\s*--", cmd[pos:])) is not None:
        start, depth = pos + m.start(), 0
        for end in range(start, len(cmd)):
            depth += (cmd[end] == "[") - (cmd[end] == "]")
            if depth == 0:
                break
        else:
            raise ValueError(f"unclosed [ in {cmd!r}")
        groups.append((start, end))
        pos = end + 1
    choices = [[""] + [a.strip() for a in re.split(r"\s\|\s", cmd[s + 1:e])] for s, e in groups]
    out = []
    for pick in itertools.product(*choices):
        text, last = "", 0
        for (s, e), p in zip(groups, pick):
            text, last = text + cmd[last:s] + p, e + 1
        out.append(" ".join((text + cmd[last:]).split()))
    return out


def recipe_command(cmd: str) -> list[str] | None:
    """The tokens after ``szo`` of a concrete recipe command; None for a template, a mention, ``--list``
    or a run's own config.yaml."""
    tokens = shlex.split(cmd)
    tokens = tokens[tokens.index("szo") + 1:]
    name = tokens[1] if len(tokens) > 1 else ""
    settings = [name] + [v for k, v in zip(tokens, tokens[1:]) if k in ("--set", "--device")]  # not --out DIR
    if any(_PLACEHOLDER.search(s) for s in settings) or name.endswith(".yaml"):
        return None
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", name):  # "--list", or prose such as "`szo recipe` / `report`"
        return None
    return tokens


def validate_command(tokens: list[str]):
    """What ``szo recipe`` does with the command before any work: parse it, then load and resolve the recipe."""
    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            args = build_parser().parse_args(tokens)
        except SystemExit:
            raise ValueError(f"szo's parser refuses {' '.join(tokens)!r}: {err.getvalue().strip()}") from None
    return recipe_config(args)[0]


def _printed() -> list[tuple[str, list[str]]]:
    out = []
    for path in DOCS:
        for line, cmd in extract(path.read_text()):
            for k, v in enumerate(variants(cmd)):
                tokens = recipe_command(v)
                if tokens is not None:
                    out.append((f"{path.relative_to(ROOT)}:{line}" + (f"#{k}" if k else ""), tokens))
    return out


PRINTED = _printed()


def test_the_docs_print_recipe_commands_in_every_form():
    assert len(PRINTED) > 20
    where = {i.split(":")[0] for i, _ in PRINTED}
    assert {"README.md", "docs/evidence.md", "docs/bn.md"} <= where
    # a continuation line, an inline span across a line break and an optional part all reach the check
    assert any("szo.scale=absolute" in t and "--out" in t for i, t in PRINTED if i.startswith("docs/bn.md"))
    assert any("subspace.name=mnist5k-resnet8-k20-seed1" in t for i, t in PRINTED if i.startswith("docs/evidence.md"))


@pytest.mark.parametrize("tokens", [t for _, t in PRINTED], ids=[i for i, _ in PRINTED])
def test_printed_recipe_command_validates(tokens):
    cfg = validate_command(tokens)
    assert cfg["name"]


def test_extract_joins_continuations_cuts_comments_and_reads_inline_spans():
    text = "\n".join([
        "Run `szo recipe digits-scratch --set",
        "method=szo-rge` or this:",
        "",
        "```bash",
        "szo recipe mnist5k-scratch --set seed=1 \\",
        "    --set train.epochs=2 --out runs/x   # a comment --set szo.mu=9",
        "torchrun --nproc_per_node=2 -m szo recipe digits-scratch --set szo.q=2 && echo done",
        "szo report runs/x",
        "```",
        "",
        "    python -m szo recipe digits-continual --set train.lr=0.1",
        "",
        "| cell | `szo recipe digits-fixed --set train.epochs=4` |",
    ])
    assert extract(text) == [
        (1, "szo recipe digits-scratch --set method=szo-rge"),
        (5, "szo recipe mnist5k-scratch --set seed=1 --set train.epochs=2 --out runs/x"),
        (7, "szo recipe digits-scratch --set szo.q=2"),
        (11, "szo recipe digits-continual --set train.lr=0.1"),
        (13, "szo recipe digits-fixed --set train.epochs=4"),
    ]


def test_optional_parts_and_templates():
    assert variants("szo recipe r --set a=1 [--set b=2 | --set c=3 --set d=[x]] --out o") == [
        "szo recipe r --set a=1 --out o", "szo recipe r --set a=1 --set b=2 --out o",
        "szo recipe r --set a=1 --set c=3 --set d=[x] --out o"]
    assert recipe_command("szo recipe mnist5k-continual --set method=M") is None
    assert recipe_command("szo recipe NAME --out DIR") is None
    assert recipe_command("szo recipe digits-fixed --out RUN_DIR") == ["recipe", "digits-fixed", "--out", "RUN_DIR"]
    assert recipe_command("szo recipe runs/rge/config.yaml") is None
    assert recipe_command("szo recipe --list") is None
    assert recipe_command("python -m szo recipe digits-scratch --set szo.mu=0.3") == [
        "recipe", "digits-scratch", "--set", "szo.mu=0.3"]


@pytest.mark.parametrize("cmd, message", [
    ("szo recipe digits-scratch --set szo.nope=1", "unknown key 'szo.nope'"),
    ("szo recipe digits-scratch --set method=no-such-method", "no-such-method"),
    ("szo recipe digits-scratch --set szo.scale=trajectory --set method=zo-cge", "szo.scale"),
    ("szo recipe digits-scratchy", "digits-scratchy"),
    ("szo recipe digits-scratch --sett szo.mu=1", "szo's parser refuses"),
])
def test_a_broken_printed_command_fails_the_check(cmd, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_command(recipe_command(cmd))
