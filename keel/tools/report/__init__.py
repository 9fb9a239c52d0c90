"""`keel report`: a run's metrics, anomalies, rollbacks and resumes as PNG plots, `report.md` and `series.json`.

read.py reads the run dir (live or finished), series.py takes each plot's numbers from it, plots.py draws them
(matplotlib, the `plot` extra) and write.py writes the report directory atomically.
"""

from keel.tools.report.write import INSTALL_HINT, Report, write_report

__all__ = ["INSTALL_HINT", "Report", "write_report"]
