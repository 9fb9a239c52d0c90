"""The README stays a user's manual and docs/ stays a set of pages a user reads, not a log.

- README.md is at most README_MAX_LINES lines and links to every page in docs/;
- every relative link in README.md, docs/ and bench/README.md reaches a file that exists (and a heading there,
  when it names one);
- no dated figure outside bench/results/: no date (2026-12-03, 20261203, "December 3, 2026"), no "stop N" history,
  no test counts. Measurements belong in bench/results/<bench>_<cpu|gpu>_<yyyymmdd>.md, whose names the pages may
  link to.

Each check is a function of the repository root, so the last test can run them on planted files and show that
they fail on the README as it was (821 lines, dated figures, suite-time history).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250

MONTHS = (
    "January|February|March|April|May|June|July|August|September|October|November|December|"
    "Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec"
)
DATED = [
    ("a date", re.compile(r"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b")),
    ("a date", re.compile(r"\b(?:19|20)\d\d(?:0[1-9]|1[0-2])(?:0[1-9]|[12]\d|3[01])\b")),
    ("a date", re.compile(rf"\b(?:{MONTHS})\.? \d{{1,2}}(?:st|nd|rd|th)?,? (?:19|20)\d\d\b")),
    ("a date", re.compile(rf"\b\d{{1,2}}(?:st|nd|rd|th)? (?:{MONTHS})\.?,? (?:19|20)\d\d\b")),
    ("'stop N' history", re.compile(r"\bstop \d+\b", re.I)),
    ("a test count", re.compile(r"\b\d+ tests\b", re.I)),
]
# a link to a dated results file may carry its date: bench/results/<bench>_<cpu|gpu>_<yyyymmdd>.md
RESULTS_LINK = re.compile(r"\bresults/[\w.-]+_(?:cpu|gpu)_\d{8}\.md\b")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def pages(repo: Path) -> list[Path]:
    """The prose outside bench/results: README.md, every docs/ page, bench/README.md."""
    found = [repo / "README.md", *sorted((repo / "docs").rglob("*.md"))]
    return found + [p for p in [repo / "bench" / "README.md"] if p.is_file()]


def readme_length_problems(repo: Path) -> list[str]:
    lines = len((repo / "README.md").read_text().splitlines())
    return (
        [f"README.md has {lines} lines; keep it at most {README_MAX_LINES} (move topics to docs/)"]
        if lines > README_MAX_LINES
        else []
    )


def unlinked_pages(repo: Path) -> list[str]:
    readme = (repo / "README.md").read_text()
    targets = {target.split("#")[0] for target in LINK.findall(readme)}
    return [
        f"README.md does not link docs/{page.relative_to(repo / 'docs').as_posix()}"
        for page in sorted((repo / "docs").rglob("*.md"))
        if page.relative_to(repo).as_posix() not in targets
    ]


def dated_figures(repo: Path) -> list[str]:
    problems = []
    for page in pages(repo):
        for number, line in enumerate(page.read_text().splitlines(), 1):
            prose = RESULTS_LINK.sub("results/LINK.md", line)
            for what, pattern in DATED:
                for hit in pattern.finditer(prose):
                    problems.append(
                        f"{page.relative_to(repo).as_posix()}:{number}: {what} ({hit.group(0)!r}): "
                        "dated figures go to bench/results/<bench>_<cpu|gpu>_<yyyymmdd>.md"
                    )
    return problems


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(repo: Path) -> list[str]:
    problems = []
    for page in pages(repo):
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue  # http(s), mailto: not checked here
                path, _, anchor = target.partition("#")
                goal = (page.parent / path).resolve() if path else page
                where = f"{page.relative_to(repo).as_posix()}:{number}: link {target!r}"
                if not goal.exists():
                    problems.append(f"{where}: no such file")
                elif anchor and goal.suffix == ".md":
                    headings = {_slug(h) for h in re.findall(r"^#+ (.+)$", goal.read_text(), re.M)}
                    if anchor not in headings:
                        problems.append(f"{where}: no heading #{anchor} there")
    return problems


def test_readme_is_at_most_250_lines():
    assert not readme_length_problems(REPO), readme_length_problems(REPO)


def test_every_docs_page_is_linked_from_the_readme():
    assert sorted((REPO / "docs").glob("*.md")), "docs/ has no pages"
    assert not unlinked_pages(REPO), "\n".join(unlinked_pages(REPO))


def test_no_dated_figure_outside_bench_results():
    assert not dated_figures(REPO), "\n".join(dated_figures(REPO))


def test_every_relative_link_reaches_a_file_and_heading():
    assert not broken_links(REPO), "\n".join(broken_links(REPO))


def test_bench_results_files_are_named_by_bench_device_and_date():
    results = sorted((REPO / "bench" / "results").glob("*"))
    assert results, "bench/results/ holds no results"
    bad = [
        p.name
        for p in results
        if not re.fullmatch(r"[a-z0-9_]+_(?:cpu|gpu)_20\d\d[01]\d[0-3]\d\.md", p.name)
    ]
    assert not bad, f"name results <bench>_<cpu|gpu>_<yyyymmdd>.md: {bad}"


# The README as it was before it became a manual (lines taken from it), for the checks to fail on.
OLD_README_LINES = [
    "every multi-process equivalence and fault test: 939 tests (921 passed, 18 skipped) in 1144 s in `.ci/run`'s "
    "fresh venv (measured 2026-12-03 on an AMD EPYC AVX-512 machine, whose first runs also JIT-build DeepSpeed's ops).",
    "machine varies: the run before it, on the same tests but for one fix, took 1660 s, its shared 2-rank launch 632 s",
    "against 260 s; 694 s at stop 21, before the fault matrix, preflight, token-check, async-checkpoint, "
    "stability-knob",
    "Measured 2026-12-02 on an AMD EPYC (2 cores, AVX-512), fp32, whole trainer step, one interleaved run each",
    "On one H200, measured on November 30, 2026: Keel 89.9k tokens/s, 36.5% MFU.",
]


def test_the_checks_fail_on_the_old_readme(tmp_path: Path):
    """An 821-line README with dated figures, suite-time history and an unlinked page fails every check; the same
    tree with a short, undated README that links its one page passes."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "faults.md").write_text(
        "# Faults\n\nSee [bench](../bench/results/x_cpu_20261203.md).\n"
    )
    (tmp_path / "README.md").write_text(
        "# Keel\n\n" + "\n".join(OLD_README_LINES) + "\n" + "filler\n" * 814
    )

    assert readme_length_problems(tmp_path) == [
        f"README.md has 821 lines; keep it at most {README_MAX_LINES} (move topics to docs/)"
    ]
    assert unlinked_pages(tmp_path) == ["README.md does not link docs/faults.md"]
    found = "\n".join(dated_figures(tmp_path))
    for hit in ("'2026-12-03'", "'939 tests'", "'stop 21'", "'2026-12-02'", "'November 30, 2026'"):
        assert hit in found, (hit, found)
    assert "docs/faults.md" not in found  # a link to a dated results file is not a dated figure
    assert [p.split(": ")[-1] for p in broken_links(tmp_path)] == [
        "no such file"
    ]  # the results file is missing

    (tmp_path / "README.md").write_text(
        "# Keel\n\nThe manual. See [faults](docs/faults.md#faults).\n"
    )
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "x_cpu_20261203.md").write_text("# x\n\n2026-12-03: 1.0\n")
    assert not readme_length_problems(tmp_path) and not unlinked_pages(tmp_path)
    assert not dated_figures(tmp_path) and not broken_links(tmp_path)


@pytest.mark.parametrize(
    "text",
    [
        "stop 21",
        "STOP 3",
        "on 2026-12-02",
        "20261202",
        "Dec 2, 2026",
        "2 December 2026",
        "939 tests",
    ],
)
def test_each_dated_pattern_is_caught(tmp_path: Path, text: str):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(f"# Keel\n\nmeasured {text}\n")
    assert dated_figures(tmp_path), text
