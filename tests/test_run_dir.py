"""`keel/run_dir/__init__.py` is the only module that names a file in the run dir or spells an exit-code number.

Read from the syntax trees of every module under keel/ (no import): a string constant that is a run-dir file name
(or ends with `/name`), and an integer given as an exit code (`sys.exit(3)`, `os._exit(4)`, `exit_code=7`, a
name like `EXIT_HANG = 4`), are each an error with file:line. Docstrings and comments may mention the names.
"""

from __future__ import annotations

import ast
from pathlib import Path

from keel.run_dir import COMPLETE, LATEST, ExitCode, RunDir

KEEL = Path(__file__).resolve().parents[1] / "keel"
HOME = KEEL / "run_dir" / "__init__.py"


def run_dir_names() -> set[str]:
    """Every name `RunDir` gives a file or directory, plus the checkpoint directory's own names."""
    layout = RunDir(Path("/r"))
    names = {
        getattr(layout, attr).name
        for attr, value in vars(RunDir).items()
        if isinstance(value, property)
    }
    return names | {COMPLETE, LATEST}


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
        ):
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _is_int(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int


def spelled_out(path: Path, names: set[str], root: Path = KEEL.parent) -> list[str]:
    """file:line for each run-dir file name or exit-code number written in `path` outside keel/run_dir/__init__.py."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _docstrings(tree)
    where = path.relative_to(root)
    found = []
    files = {
        name for name in names if "." in name
    }  # a file name is never an ordinary word: any use counts
    joined = set()  # a directory name ("checkpoints", "report") counts where it is joined to a path
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Div)
            and isinstance(node.right, ast.Constant)
        ):
            joined.add(id(node.right))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            text = node.value
            if (
                text in files
                or any(text.endswith("/" + name) or text.startswith(name + "/") for name in names)
                or (id(node) in joined and text in names)
            ):
                found.append(f"{where}:{node.lineno}: run-dir name {text!r}")
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if "exit" in called.lower() and node.args and _is_int(node.args[0]):  # exit_now(2) too
                found.append(f"{where}:{node.lineno}: exit code {node.args[0].value} in {called}()")
            for keyword in node.keywords:
                if (
                    keyword.arg == "exit_code"
                    and _is_int(keyword.value)
                    and keyword.value.value != 0
                ):
                    found.append(f"{where}:{node.lineno}: exit_code={keyword.value.value}")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and _is_int(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", "")
                if name.isupper() and "EXIT" in name:  # a module constant such as EXIT_HANG = 4
                    found.append(
                        f"{where}:{node.lineno}: exit code constant {name} = {node.value.value}"
                    )
    return found


def test_no_module_but_run_dir_spells_a_run_dir_name_or_an_exit_code():
    names = run_dir_names()
    found = [
        line
        for path in sorted(KEEL.rglob("*.py"))
        if path != HOME
        for line in spelled_out(path, names)
    ]
    assert not found, "name these through keel.run_dir (RunDir, ExitCode):\n" + "\n".join(found)


def test_the_check_finds_what_it_is_for(tmp_path):
    """The check itself, on a planted module: each kind of spelling is found, a docstring mention is not."""
    # must sit under keel/ for relative_to; removed below
    planted = tmp_path / "keel" / "planted.py"
    planted.parent.mkdir()
    planted.write_text(
        '"""Writes metrics.jsonl."""\nimport os, sys\nEXIT_HANG = 4\n'
        'def f(run_dir):\n    """anomalies.jsonl"""\n    p = run_dir / "metrics.jsonl"\n'
        '    r = run_dir / "stacks"\n    key = "tensorboard"\n'
        '    q = f"{run_dir}/checkpoints"\n    os._exit(4)\n    sys.exit(2)\n    exit_now(3)\n'
        '    g(exit_code=7)\n    return "x/latest"\n'
    )
    found = spelled_out(planted, run_dir_names(), tmp_path)
    lines = [line.split(": ", 1)[1] for line in found]
    assert sorted(lines) == sorted(
        [
            "exit code constant EXIT_HANG = 4",
            "run-dir name 'metrics.jsonl'",
            "exit code 4 in _exit()",
            "exit code 2 in exit()",
            "exit code 3 in exit_now()",
            "exit_code=7",
            "run-dir name '/checkpoints'",
            "run-dir name 'x/latest'",
            "run-dir name 'stacks'",
        ]
    ), found


def test_exit_codes_are_one_table():
    """Each code once (BAD_DATA is USAGE's alias by design: bad input, found later), 0 to 9 with no gap."""
    assert [code.value for code in ExitCode] == list(range(10))
    assert ExitCode.BAD_DATA is ExitCode.USAGE
    doc = ExitCode.__doc__ or ""
    assert all(f"{code.value}     {code.name}" in doc for code in ExitCode), (
        "the docstring's table lists every code"
    )
