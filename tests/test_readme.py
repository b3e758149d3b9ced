"""The README's examples as written. Its Python snippets name nothing they do not define or
import (and, with the real SmolLM2-135M, run); every `llmc` line of its shell examples parses
with llmc's own parser, with pass names and --set options that exist (none of them runs: some
take minutes); the command synopses name only flags their command has."""
import argparse
import ast
import builtins
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from llmaccel.bench.suite import parse_args as suite_args
from llmaccel.cli import build_parser
from llmaccel.compiler.pipeline import parse_pass_list
from llmaccel.compiler.registry import get_pass
from llmaccel.passes.base import make_config, parse_sets

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"^```(\w+)\n(.*?)^```$", (ROOT / "README.md").read_text(), flags=re.M | re.S)
PYTHON = [body for lang, body in BLOCKS if lang == "python"]


def _shell_commands() -> list[list[str]]:
    """The argv of each line of the sh blocks: comments and a trailing & dropped."""
    out = []
    for body in (body for lang, body in BLOCKS if lang == "sh"):
        for line in body.splitlines():
            argv = shlex.split(line, comments=True)
            out.append(argv[:-1] if argv and argv[-1] == "&" else argv)
    return [a for a in out if a]


def _after_env(argv: list[str]) -> list[str]:
    """The command after leading VAR=value assignments."""
    while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
        argv = argv[1:]
    return argv


COMMANDS = [_after_env(a) for a in _shell_commands()]
LLMC = [a for a in COMMANDS if Path(a[0]).name == "llmc"]
SUITE = [a for a in COMMANDS if a[:3] == ["python", "-m", "llmaccel.bench.suite"]]


def _subcommands(ap: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices


def _unbound_names(src: str) -> set[str]:
    """Names a snippet reads that it neither imports nor assigns, and Python does not provide."""
    tree = ast.parse(src)
    bound, read = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.Name):
            (bound if isinstance(node.ctx, ast.Store) else read).add(node.id)
    return read - bound


def test_the_readme_has_its_examples():
    assert len(PYTHON) >= 2 and len(LLMC) >= 12 and len(SUITE) == 2
    assert any(lang == "text" for lang, _ in BLOCKS)


@pytest.mark.parametrize("i", range(len(PYTHON)))
def test_python_snippets_define_what_they_use(i):
    assert not _unbound_names(PYTHON[i]), PYTHON[i]


@pytest.mark.parametrize("argv", LLMC + SUITE, ids=lambda a: " ".join(a)[:80])
def test_command_lines_parse(argv):
    if argv[0] == "python":
        suite_args(argv[3:])
        return
    a = build_parser().parse_args(argv[1:])
    if a.cmd in ("compile", "show"):  # pass names, their order and their options, as compile checks them
        names = parse_pass_list(a.passes)
        for name, opts in parse_sets(a.set).items():
            assert name in names, f"--set {name}.* without the pass"
            make_config(get_pass(name), opts)


def test_synopses_name_only_flags_their_command_has():
    subs = _subcommands(build_parser())
    (text,) = [body for lang, body in BLOCKS if lang == "text"]
    # one command per unindented line, continued by the indented ones; comments are prose
    for synopsis in re.split(r"\n(?=llmc )", re.sub(r"#[^\n]*", "", text).strip()):
        cmd = synopsis.split()[1]
        flags = set(re.findall(r"(?<![\w-])--?[a-z][\w-]*", synopsis))
        assert flags and flags <= set(subs[cmd]._option_string_actions), (cmd, flags)
    assert set(re.findall(r"^llmc (\w+)", text, flags=re.M)) == set(subs)


@pytest.mark.real
@pytest.mark.parametrize("i", range(len(PYTHON)))
def test_python_snippets_run(i):
    """As a user runs them: from the repository root, Triton not in its interpreter (the
    test session sets TRITON_INTERPRET without a GPU); about a minute each on 2 cores."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", PYTHON[i]], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "Paris" in r.stdout
