"""The Faults table (docs/faults.md) and the fault-marked tests correspond exactly: one row per
`@pytest.mark.fault(fault, action)` mark, with the mark's own two strings and the test's id (`tests/FILE.py::NAME`,
parameters left out).

The marks are read from the test files' syntax trees (every tests/**/test_*.py, in a fraction of a second, without
importing torch), so the check sees tests that this session did not collect, including the slow ones. A fault mark
written anywhere the reader cannot attribute to a test (a mark kept in a variable, one built at run time) is an
error rather than a silent gap; a mark on one `pytest.param` counts for its test. The tests this session collected
are checked once more against pytest's own marks (tests/conftest.py gathers them for the printed fault matrix), so
the reader and pytest cannot disagree.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import FAULT_ROWS

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
FAULTS_PAGE = "docs/faults.md"  # the table's home, relative to REPO (README.md links to it)
HEADER = "| fault | what Keel does | test |"
ROW = re.compile(r"^\| (?P<fault>[^|`]+?) \| (?P<action>[^|`]+?) \| `(?P<test>tests/[^`|]+)` \|$")


def _fault_mark(node: ast.AST) -> ast.Call | None:
    """`node` if it is `pytest.mark.fault(...)` (or `mark.fault(...)`)."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "fault"
    ):
        owner = node.func.value
        if (isinstance(owner, ast.Attribute) and owner.attr == "mark") or (
            isinstance(owner, ast.Name) and owner.id == "mark"
        ):
            return node
    return None


def _strings(call: ast.Call, where: str) -> tuple[str, str]:
    args = call.args
    if (
        call.keywords
        or len(args) != 2
        or not all(
            isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.strip()
            for a in args
        )
    ):
        raise AssertionError(
            f'{where}: write the fault mark as @pytest.mark.fault("fault", "what Keel does"), '
            "two non-empty string literals"
        )
    fault, action = (a.value for a in args)
    if any(c in fault + action for c in "|`\n"):
        raise AssertionError(
            f"{where}: a fault mark's strings may not hold '|', '`' or a line break (a table cell)"
        )
    return fault, action


def _marks_in(nodes: list[ast.expr], path: str, seen: set[int]) -> list[tuple[str, str]]:
    marks = []
    for node in nodes:
        for sub in ast.walk(node):
            if (call := _fault_mark(sub)) is not None:
                seen.add(id(call))
                marks.append(_strings(call, f"{path}:{call.lineno}"))
    return marks


def read_marks() -> tuple[dict[str, list[tuple[str, str]]], set[str]]:
    """({test id: [(fault, action), ...]} for every fault-marked test, every test id) from the test sources."""
    marked: dict[str, list[tuple[str, str]]] = {}
    tests: set[str] = set()
    for file in sorted(TESTS.rglob("test_*.py")):
        path = file.relative_to(REPO).as_posix()
        tree = ast.parse(file.read_text(), path)
        seen: set[int] = set()
        module = _marks_in(
            [
                n.value
                for n in tree.body
                if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)
            ],
            path,
            seen,
        )
        _visit(tree.body, path, path, module, seen, marked, tests)
        stray = [
            n.lineno for n in ast.walk(tree) if _fault_mark(n) is not None and id(n) not in seen
        ]
        assert not stray, (
            f"{path}, line(s) {stray}: a fault mark that is not a decorator of a test (or the "
            "module's pytestmark); write it as @pytest.mark.fault(...) on the test so the "
            f"Faults table ({FAULTS_PAGE}) can be checked against it"
        )
    return marked, tests


def _visit(
    body: list[ast.stmt],
    prefix: str,
    path: str,
    inherited: list[tuple[str, str]],
    seen: set[int],
    marked: dict[str, list[tuple[str, str]]],
    tests: set[str],
) -> None:
    """Test functions and Test classes' methods in `body`, with the marks of the module and classes around them."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith(
            "test"
        ):
            test = f"{prefix}::{node.name}"
            tests.add(test)
            marks = inherited + _marks_in(node.decorator_list, path, seen)
            if marks:
                marked[test] = marks
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            _visit(
                node.body,
                f"{prefix}::{node.name}",
                path,
                inherited + _marks_in(node.decorator_list, path, seen),
                seen,
                marked,
                tests,
            )


def readme_rows() -> list[tuple[str, str, str]]:
    """(test id, fault, action) per row of the Faults table in docs/faults.md, in order."""
    lines = (REPO / FAULTS_PAGE).read_text().splitlines()
    assert lines.count(HEADER) == 1, (
        f"{FAULTS_PAGE} needs exactly one Faults table starting with the line {HEADER!r}"
    )
    start = lines.index(HEADER) + 2  # after the header's |---| line
    rows = []
    for number, line in enumerate(lines[start:], start + 1):
        if not line.startswith("|"):
            break
        found = ROW.match(line)
        assert found, (
            f"{FAULTS_PAGE} line {number}: a Faults row is '| fault | what Keel does | `tests/FILE.py::NAME` |'"
        )
        rows.append((found["test"], found["fault"], found["action"]))
    return rows


def test_readme_faults_table_lists_exactly_the_fault_marked_tests():
    marked, tests = read_marks()
    rows = readme_rows()
    wanted = Counter((test, *mark) for test, marks in marked.items() for mark in marks)
    listed = Counter(rows)
    problems = [f"listed {n} times: {row}" for row, n in listed.items() if n > 1]
    for test, fault, action in sorted(listed.keys() - wanted.keys()):
        if test not in tests:
            problems.append(f"{FAULTS_PAGE} names {test}, which does not exist")
        elif test not in marked:
            problems.append(f"{FAULTS_PAGE} names {test}, which has no @pytest.mark.fault")
        else:
            problems.append(
                f"{FAULTS_PAGE} row ({fault!r}, {action!r}) for {test} matches none of its marks "
                f"{marked[test]}"
            )
    for test, fault, action in sorted(wanted.keys() - listed.keys()):
        problems.append(f"no {FAULTS_PAGE} row for {test}: | {fault} | {action} | `{test}` |")
    assert not problems, f"{FAULTS_PAGE}'s Faults table and the fault marks differ:\n" + "\n".join(
        problems
    )
    assert marked and rows  # a reader that finds nothing must not pass


def test_the_source_reader_agrees_with_pytests_own_marks(request):
    """Every fault-marked test this session collected: the mark pytest sees is the one the reader found."""
    marked, _ = read_marks()
    collected = request.config.stash[FAULT_ROWS]  # set at every collection (tests/conftest.py)
    session = {re.sub(r"\[.*\]$", "", item.nodeid) for item in request.session.items}
    assert {test for test in marked if test in session} == {
        re.sub(r"\[.*\]$", "", n) for n, _, _ in collected
    }
    for nodeid, fault, action in collected:
        test = re.sub(r"\[.*\]$", "", nodeid)
        assert (fault, action) in marked.get(test, []), (
            f"{nodeid}: pytest sees the fault mark ({fault!r}, "
            f"{action!r}), the source reader does not"
        )


def test_the_check_names_a_missing_row_a_missing_test_and_a_stray_mark(tmp_path, monkeypatch):
    """The check can fail: a new marked test in tests/faults/ without a row, a row naming no test, and a fault
    mark the reader cannot attribute."""
    check = sys.modules[__name__]
    fake_tests = tmp_path / "tests"
    (fake_tests / "faults").mkdir(parents=True)
    (fake_tests / "faults" / "test_new.py").write_text(
        'import pytest\n\n@pytest.mark.fault("disk full", "save set aside")\ndef test_disk_full():\n    pass\n'
    )
    (fake_tests / "test_stray.py").write_text(
        "import pytest\n\nFAULT = pytest.mark.fault('a', 'b')\n\n@FAULT\ndef test_named_mark():\n    pass\n"
    )
    monkeypatch.setattr(check, "REPO", tmp_path)
    monkeypatch.setattr(check, "TESTS", fake_tests)
    with pytest.raises(
        AssertionError, match=r"tests/test_stray.py, line\(s\) \[3\]: a fault mark that is not"
    ):
        check.read_marks()
    (fake_tests / "test_stray.py").unlink()
    (tmp_path / "docs").mkdir()
    (tmp_path / FAULTS_PAGE).write_text(
        f"# Faults\n\n{HEADER}\n|---|---|---|\n"
        "| lost node | resharded | `tests/test_gone.py::test_gone` |\n\nafter\n"
    )
    with pytest.raises(AssertionError) as err:
        test_readme_faults_table_lists_exactly_the_fault_marked_tests()
    message = str(err.value)
    assert "docs/faults.md names tests/test_gone.py::test_gone, which does not exist" in message
    assert (
        "no docs/faults.md row for tests/faults/test_new.py::test_disk_full: | disk full | save set aside | "
        "`tests/faults/test_new.py::test_disk_full` |" in message
    )
