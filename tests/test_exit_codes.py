"""One table of exit codes (app/exit_codes.py): every command returns its members and no number of its own, the
table in docs/operations.md is the module's, it is the only such table in the docs, and `finetune --help` ends
with it. Read from the source and run in-process; no Ray, no cluster."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from app import cli, exit_codes
from app.exit_codes import TABLE, Exit

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "app"
COMMAND_MODULES = ("cli.py", "ops.py")  # the `finetune` commands: every code they return is an Exit
EXITS = {"OpsError": 1, "_exit": 0, "exit": 0, "SystemExit": 0}  # call -> position of its exit code


def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def literal_codes(path: Path) -> list[str]:
    """'file:line' wherever an exit code is a bare number: an argument of OpsError, os._exit, sys.exit or SystemExit,
    or, in the command modules, a `return` of a function annotated `-> Exit` or named cmd_*/main."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _name(node.func) in EXITS:
            at = EXITS[_name(node.func)]
            args = node.args[at : at + 1] + [k.value for k in node.keywords if k.arg == "code"]
            found += [
                f"{path.name}:{node.lineno}" for a in args if isinstance(a, ast.Constant) and type(a.value) is int
            ]
        if not (isinstance(node, ast.FunctionDef) and path.name in COMMAND_MODULES):
            continue
        annotated = _name(node.returns) if node.returns else ""
        if (node.name.startswith("cmd_") or node.name == "main") and annotated != "Exit":
            found.append(f"{path.name}:{node.lineno} {node.name} is not annotated -> Exit")
        if annotated == "Exit":
            returns = [r for r in ast.walk(node) if isinstance(r, ast.Return) and isinstance(r.value, ast.Constant)]
            found += [f"{path.name}:{r.lineno}" for r in returns if type(r.value.value) is int]
    return found


def test_no_command_returns_a_number_outside_the_table():
    offenders = [line for path in sorted(APP.rglob("*.py")) for line in literal_codes(path)]
    assert not offenders, "use app.exit_codes.Exit instead of these numbers:\n" + "\n".join(offenders)


def test_the_check_finds_bare_numbers(tmp_path):
    (tmp_path / "cli.py").write_text(
        "def cmd_a(args) -> Exit:\n    return 7\n"
        "def cmd_b(args) -> int:\n    return Exit.OK\n"
        "def f():\n    raise OpsError('x', 3)\n"
        "def g():\n    os._exit(Exit.LEASE_HELD)\n"
    )
    assert literal_codes(tmp_path / "cli.py") == ["cli.py:2", "cli.py:3 cmd_b is not annotated -> Exit", "cli.py:6"]


def test_every_code_has_one_meaning_and_the_docs_table_is_the_modules():
    assert set(TABLE) == set(Exit) and len({int(c) for c in Exit}) == len(Exit)
    docs = (ROOT / "docs" / "operations.md").read_text()
    assert exit_codes.markdown() in docs, "regenerate the table in docs/operations.md: python -m app.exit_codes"
    elsewhere = [
        str(p.relative_to(ROOT))
        for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
        if p.name not in ("operations.md", "benchmarks-history.md")
        and re.search(r"^#+ Exit codes|^\| *code *\|", p.read_text(), re.M | re.I)
    ]
    assert not elsewhere, f"exit codes are documented once, in docs/operations.md; link to it from {elsewhere}"


def test_help_ends_with_the_table():
    shown = " ".join(cli.build_parser().format_help().split())
    assert shown.endswith(exit_codes.epilog()), shown[-400:]


@pytest.mark.parametrize(
    "argv, code",
    [
        (["export", "/nonexistent/experiment", "out"], Exit.INVALID),
        (["status", "./no/such/folder"], Exit.INVALID),
        (["status", "Not A Name!"], Exit.INVALID),
        (["status", "exp1"], Exit.API_UNREACHABLE),
        (["preempt", "{tmp}"], Exit.OK),
    ],
)
def test_commands_return_members_of_the_table(argv, code, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    got = cli.main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert type(got) is Exit and got == code, (got, capsys.readouterr().err)
