"""Every ``graphstep ...`` command shown in README.md and docs/*.md works as written.

Commands are taken from fenced code blocks (``graphstep X``, ``python -m
graphstep X``, ``torchrun ... -m graphstep X``, ``scripts/train``,
``scripts/graphstep``); continuation lines are joined and ``# comments``
dropped. Each is parsed by the real argument parser; a command that takes a
config (train, doctor, bench, config) is resolved the way the command would
resolve it and validated -- with the world size torchrun would give -- and
must be clean (``config validate`` lines may show violations: that is what
they demonstrate). Paths that only exist on the user's machine (a Hugging
Face directory, a tokenizer, a script) are the only thing allowed to be
missing. Every recipe a doc names exists, and the README lists every recipe.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from graphstep.cli import _late_overrides, build_parser
from graphstep.config_files import config_from_args
from graphstep.recipes import RECIPES
from graphstep.validation import validate_config
from helpers.launch import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SUBCOMMANDS = ("train", "config", "doctor", "bench", "preprocess", "export")
USER_PATH_FIELDS = {"model.hf_path", "data.tokenizer"}  # paths on the user's machine, absent here
CLEAN_EXPECTED = ("train", "doctor", "bench")


def _code_lines(text: str) -> list[str]:
    """The lines of every fenced code block, continuation lines joined, comments dropped."""
    out, inside, pending = [], False, ""
    for line in text.splitlines():
        if line.strip().startswith("```"):
            inside = not inside
            continue
        if not inside:
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append(re.sub(r"\s#\s.*$", "", pending + line).strip())
        pending = ""
    return out


def _as_graphstep_args(line: str) -> list[str] | None:
    """The arguments after ``graphstep`` in a shell line, or None when the line runs no graphstep command."""
    match = re.search(r"(?:^|\s)(?:python3? -m |-m |scripts/)?graphstep\s+(.*)$", line)
    if match is None:
        match = re.search(r"(?:^|\s)scripts/train\b(.*)$", line)
        if match is None:
            return None
        return ["train", *_words(match.group(1))]
    words = _words(match.group(1))
    return words if words and words[0] in SUBCOMMANDS else None


def _words(text: str) -> list[str]:
    """Shell words, with usage-synopsis brackets (``[--json]``, ``[section.field=value ...]``) and ``...`` dropped."""
    text = re.sub(r"\[(?:--|[^\]]*\s)[^\]]*\]", " ", text)
    return [w for w in shlex.split(text) if w != "..."]


def _world_size(line: str) -> int:
    nodes = re.search(r"--nnodes[ =](\d+)", line)
    per_node = re.search(r"--nproc_per_node[ =](\d+)", line)
    return (int(nodes.group(1)) if nodes else 1) * (int(per_node.group(1)) if per_node else 1)


def _commands() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for line in _code_lines(doc.read_text()):
            if _as_graphstep_args(line) is not None:
                found.append((doc.name, line))
    return found


COMMANDS = _commands()


def test_the_docs_show_commands() -> None:
    names = {doc for doc, _line in COMMANDS}
    assert {"README.md", "distributed.md", "data.md"} <= names
    assert len(COMMANDS) >= 15


@pytest.mark.parametrize("doc, line", COMMANDS, ids=[f"{d}:{i}" for i, (d, _l) in enumerate(COMMANDS)])
def test_documented_command_works(doc: str, line: str) -> None:
    args = _as_graphstep_args(line)
    parser = build_parser()
    try:
        ns, extra = parser.parse_known_args(args)
        _late_overrides(parser, ns, extra)
    except SystemExit as exc:
        pytest.fail(f"{doc}: `{line}` does not parse (exit {exc.code})")
    if not hasattr(ns, "overrides"):
        return  # preprocess, export: parsed; their inputs are the user's files
    ns.overrides = [o for o in ns.overrides if not o.split(":", 1)[0].endswith(".py")]  # doctor script targets
    cfg = config_from_args(ns)
    violations = validate_config(cfg, env={}, world_size=_world_size(line))
    real = [v for v in violations if not (set(v.fields) <= USER_PATH_FIELDS and _names_missing_path(v, cfg))]
    if args[0] in CLEAN_EXPECTED:
        assert real == [], f"{doc}: `{line}`:\n" + "\n".join(map(str, real))


def _names_missing_path(violation, cfg) -> bool:
    paths = [getattr(getattr(cfg, f.split(".")[0]), f.split(".")[1]) for f in violation.fields]
    return all(isinstance(p, str) and p != "byte" and not Path(p).exists() for p in paths)


def test_every_recipe_the_docs_name_exists() -> None:
    named = set()
    for doc in DOCS:
        found = re.findall(r"--recipe[ =]+([A-Za-z0-9_]+)", doc.read_text())
        named |= {(doc.name, m) for m in found if not m.isupper()}  # `--recipe R`, `NAME`: placeholders
    assert named, "the docs name recipes"
    unknown = sorted((doc, name) for doc, name in named if name not in RECIPES)
    assert unknown == [], f"unknown recipes in the docs: {unknown}"


def test_readme_lists_every_recipe() -> None:
    text = (ROOT / "README.md").read_text()
    paragraph = text[text.index("Recipes:"):].split("\n\n", 1)[0]
    listed = set(re.findall(r"`([a-z0-9_]+)`", paragraph))
    assert listed == set(RECIPES), f"README recipes: missing {set(RECIPES) - listed}, unknown {listed - set(RECIPES)}"


def test_the_extractor_reads_commands_as_a_shell_would() -> None:
    assert _as_graphstep_args("torchrun --nproc_per_node 2 -m graphstep train a.b=1") == ["train", "a.b=1"]
    assert _as_graphstep_args("graphstep doctor: train.py:train_step") is None  # report output, not a command
    assert _as_graphstep_args("graphstep doctor --recipe r [section.field=value ...] [--json]") == [
        "doctor", "--recipe", "r"]
    assert _as_graphstep_args("scripts/train train.train_iters=5") == ["train", "train.train_iters=5"]
    assert _words("model.cuda_graph_modules=[attn,mlp] ...") == ["model.cuda_graph_modules=[attn,mlp]"]
    assert _world_size("torchrun --nnodes 4 --nproc_per_node 8 -m graphstep train") == 32
