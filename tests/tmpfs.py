# A RAM-backed disk for the full-disk tests (a tmpfs, as on a board with a read-only root), and filling it.
from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

PAGE = 4096


@contextlib.contextmanager
def mounted_tmpfs(folder: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (RAM-backed, as on a board with a read-only root) at this new folder, unmounted at the end
    (the test is skipped where mounting is not permitted)."""
    folder.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode()[:120]}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def free_bytes(folder: Path) -> int:
    """The bytes a file system still has for its files."""
    stats = os.statvfs(folder)
    return stats.f_bavail * stats.f_frsize


def fill_leaving(folder: Path, pages: int) -> Path:
    """A filler file taking all but `pages` pages of the file system's free space (blocks really written)."""
    filler = folder / "filler"
    with open(filler, "ab") as handle:
        handle.write(b"\1" * (free_bytes(folder) - pages * PAGE))
    assert free_bytes(folder) == pages * PAGE
    return filler
