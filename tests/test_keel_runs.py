"""The shared-launch helper reads each run's exit code from the summary the trainer writes (tests/keel_runs.py):
tied here to `write_summary`'s own format, so a change there cannot make a stopped run read as finished."""

from __future__ import annotations

from keel.training.observe.summary import write_summary
from tests.keel_runs import summary_exit_code


def test_summary_exit_code_reads_what_write_summary_wrote(tmp_path):
    assert summary_exit_code(tmp_path) is None  # no summary: the run never ended on rank 0
    for finished, code, reason, want in (
        (True, 0, "", 0),
        (False, 0, "exit_after", 0),
        (False, 3, "parameter checksum mismatch", 3),
        (False, 8, "", 8),
    ):
        write_summary(tmp_path, finished, code, reason)
        assert summary_exit_code(tmp_path) == want, (finished, code, reason)
