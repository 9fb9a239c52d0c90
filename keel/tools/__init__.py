"""Tools that read a run dir or a config: preflight, export, report, lr-find. Never the CLI, never the loop."""
