"""The verdict as one table on stdout and as `preflight.json` in the run dir (written aside, then renamed)."""

from __future__ import annotations

import dataclasses
import json
import os
import textwrap
from pathlib import Path

from keel.run_dir import RunDir
from keel.tools.preflight.clock import ClockOffset
from keel.tools.preflight.judge import RankRecord, Verdict


def verdict_line(verdict: Verdict, hosts: dict[int, str]) -> str:
    """The one line that says what to do: healthy, or which ranks (on which hosts) and why."""
    bad = verdict.bad_ranks
    if not bad:
        return "keel preflight: healthy" + (
            f" ({len(verdict.warnings)} warning(s))" if verdict.warnings else ""
        )
    named = ", ".join(f"{rank} ({hosts.get(rank, '?')})" for rank in bad)
    reasons = "; ".join(dict.fromkeys(reason for reasons in bad.values() for reason in reasons))
    return f"keel preflight: exit {verdict.exit_code}, bad ranks {named}: {reasons}"


def table(verdict: Verdict, header: str, hosts: dict[int, str]) -> str:
    width = max(len(c.name) for c in verdict.checks)
    lines = [header, f"{'check':<{width}}  {'verdict':<7}  result"]
    for check in verdict.checks:
        lines.append(f"{check.name:<{width}}  {check.verdict:<7}  {check.summary}")
        for finding in check.findings:
            lines += textwrap.wrap(
                ("BAD: " if finding.fatal else "warning: ") + finding.message,
                116,
                initial_indent=" " * (width + 11),
                subsequent_indent=" " * (width + 13),
            )
    lines.append(verdict_line(verdict, hosts))
    return "\n".join(lines)


def write_report(
    run_dir: Path,
    verdict: Verdict,
    records: list[RankRecord],
    offsets: list[ClockOffset],
    topology: dict,
    elapsed_s: float,
    needs: dict,
) -> Path:
    report = {
        "healthy": not verdict.bad_ranks,
        "exit_code": verdict.exit_code,
        "bad_ranks": {str(rank): reasons for rank, reasons in verdict.bad_ranks.items()},
        "warnings": verdict.warnings,
        "elapsed_s": round(elapsed_s, 3),
        "topology": topology,
        "needs": needs,
        "checks": [
            {
                "name": c.name,
                "verdict": c.verdict,
                "summary": c.summary,
                "findings": [dataclasses.asdict(f) for f in c.findings],
            }
            for c in verdict.checks
        ],
        "clock": [dataclasses.asdict(o) for o in offsets],
        "ranks": [dataclasses.asdict(r) for r in sorted(records, key=lambda r: r.rank)],
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    path = RunDir(run_dir).preflight
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, path)
    return path
