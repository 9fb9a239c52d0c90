"""Write-then-rename helpers: a reader sees either the old file or the complete new one, never a partial one."""

from __future__ import annotations

import os
import uuid
from pathlib import Path


def temp_sibling(path: Path) -> Path:
    """A unique hidden name next to `path` (same filesystem, so os.replace is atomic)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a synced temporary file and a rename."""
    tmp = temp_sibling(path)
    try:
        with open(tmp, "xb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
