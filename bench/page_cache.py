"""Evicting files from the page cache, so a bench's next read of them comes from the disk (a cold read)."""

from __future__ import annotations

import os
from pathlib import Path


def drop_cache(*paths: Path) -> bool:
    """fsync each file (its pages are then clean) and ask the kernel to drop them; False where the OS cannot
    (no posix_fadvise: the reads that follow are warm)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True
