# The agent's memory footprint: peak RSS per phase of a round (receive, score, label, train, publish), from /proc.
from __future__ import annotations

import logging
import resource
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

STATUS_FILE = Path("/proc/self/status")
CLEAR_REFS_FILE = Path("/proc/self/clear_refs")
PHASES = ("idle", "receive", "score", "label", "train", "publish")


def _status_kb(key: str) -> float | None:
    """A kB field of /proc/self/status (VmRSS, VmHWM), or None where there is no such file."""
    try:
        for line in STATUS_FILE.read_text().splitlines():
            if line.startswith(f"{key}:"):
                return float(line.split()[1])
    except OSError:
        return None
    return None


def peak_rss_mb() -> float:
    """The process's peak resident set size since start or since the last reset_peak, in MB."""
    peak = _status_kb("VmHWM")
    if peak is None:
        peak = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak / 1024.0


def current_rss_mb() -> float:
    """The process's resident set size now, in MB (0 where /proc is missing)."""
    return (_status_kb("VmRSS") or 0.0) / 1024.0


def reset_peak() -> bool:
    """Restarts the peak RSS from the current RSS (Linux's clear_refs 5); False where the kernel refuses."""
    try:
        CLEAR_REFS_FILE.write_text("5")
    except OSError:
        return False
    return True


class PhaseMeter:
    """Peak RSS of each phase of the agent's work (the peak is reset at each phase's start), and the overall peak."""

    def __init__(self) -> None:
        self.peaks: dict[str, float] = {}
        self.overall = peak_rss_mb()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measures the peak RSS of the enclosed work as phase `name` (the highest of its occurrences is kept)."""
        reset_peak()
        try:
            yield
        finally:
            self.note(name)

    def note(self, name: str) -> float:
        """Records the peak since the last reset as phase `name` and starts the next phase; returns that peak."""
        peak = peak_rss_mb()
        self.peaks[name] = max(self.peaks.get(name, 0.0), peak)
        self.overall = max(self.overall, peak)
        reset_peak()
        return peak

    def report(self) -> dict[str, float]:
        """Phase -> peak MB (rounded to 0.1), in PHASES order, plus 'overall'."""
        known = [name for name in PHASES if name in self.peaks] + sorted(set(self.peaks) - set(PHASES))
        return {**{name: round(self.peaks[name], 1) for name in known}, "overall": round(self.overall, 1)}

    def log(self, round_id: int) -> None:
        """One structured line with every phase's peak so far."""
        fields = " ".join(f"{name}={value:.1f}" for name, value in self.report().items())
        log.info("footprint round=%d peak_rss_mb %s", round_id, fields)
