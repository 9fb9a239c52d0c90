"""`data.corpus` entries: plain paths/globs (one source), or `{path, weight}` mappings (a weighted blend).

All entries are weighted or none are; weights are positive and normalized later. Checked before any rank starts.
"""

from __future__ import annotations

import math
from typing import Any

from keel.config.schema import ConfigError

_KEYS = {"path", "weight"}


def weighted_sources(corpus: list[Any]) -> list[tuple[list[str], float]] | None:
    """[(paths, weight)] for a weighted corpus, None for plain strings; a bad entry is one ConfigError line."""
    if not corpus:
        raise ConfigError("data.corpus: give at least one file, glob, or 'default'")
    mappings = [isinstance(e, dict) for e in corpus]
    if not any(mappings):
        for i, entry in enumerate(corpus):
            if not isinstance(entry, str) or not entry:
                raise ConfigError(
                    f"data.corpus[{i}]: expected a path, glob or 'default', got {entry!r}"
                )
        return None
    if not all(mappings):
        raise ConfigError(
            "data.corpus: weight every entry ({path: ..., weight: ...}) or none of them"
        )
    sources = []
    for i, entry in enumerate(corpus):
        unknown = set(entry) - _KEYS
        if unknown or "path" not in entry or "weight" not in entry:
            raise ConfigError(
                f"data.corpus[{i}]: expected {{path: ..., weight: ...}}, got {entry!r}"
            )
        paths = entry["path"] if isinstance(entry["path"], list) else [entry["path"]]
        if not paths or not all(isinstance(p, str) and p for p in paths):
            raise ConfigError(
                f"data.corpus[{i}].path: expected a path or glob (or a list of them), "
                f"got {entry['path']!r}"
            )
        weight = entry["weight"]
        if (
            isinstance(weight, bool)
            or not isinstance(weight, (int, float))
            or not math.isfinite(weight)
            or weight <= 0
        ):
            raise ConfigError(
                f"data.corpus[{i}].weight: expected a positive number, got {weight!r}"
            )
        sources.append(([str(p) for p in paths], float(weight)))
    return sources
