# Benchmark (issue 14): `simulate --devices 1000` as virtual devices in a few workers; prints JSON.
"""Runs `fl-bench simulate` with many virtual devices (small pools, 5 labels a round, 1 epoch, embedded
broker) and, as the baseline in the same run, a few devices with one process each. For each run: every round's
seconds and where they went (announcement to first accepted update, first to last, last to the round's close),
updates accepted and rejected, CPU seconds per kind of process, and memory: the peak of the summed RSS of every
process (coordinator, workers or agents, mosquitto; sampled from /proc twice a second) and the sum of each
process's own peak (VmHWM), checked against the bound.

    python benchmarks/virtual_fleet.py --devices 1000 --baseline-devices 8
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

SAMPLE_SECONDS = 0.5
TICKS = os.sysconf("SC_CLK_TCK")
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


@dataclass
class ProcessPeak:
    """What was last seen of one process: its kind, own peak RSS (VmHWM) and CPU seconds."""

    kind: str
    hwm_mb: float = 0.0
    cpu_seconds: float = 0.0


@dataclass
class TreeSampler:
    """Samples the RSS, VmHWM and CPU time of a process and all its descendants until stopped."""

    root: int
    processes: dict[int, ProcessPeak] = field(default_factory=dict)
    peak_total_rss_mb: float = 0.0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        """Samples every SAMPLE_SECONDS until `stop` is set."""
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(SAMPLE_SECONDS)

    def sample(self) -> None:
        """One look at the whole tree: the summed RSS now, and each process's peak and CPU so far."""
        total = 0.0
        for pid in descendants(self.root) | {self.root}:
            status = read_status(pid)
            if status is None:
                continue
            rss, hwm = status
            total += rss
            seen = self.processes.setdefault(pid, ProcessPeak(kind_of(pid)))
            seen.hwm_mb = max(seen.hwm_mb, hwm)
            seen.cpu_seconds = max(seen.cpu_seconds, cpu_seconds(pid))
        self.peak_total_rss_mb = max(self.peak_total_rss_mb, total)


def descendants(root: int) -> set[int]:
    """Every process below `root` (from each process's parent in /proc/PID/stat)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                parent = int(Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def read_status(pid: int) -> tuple[float, float] | None:
    """(VmRSS, VmHWM) of a process in MB, or None once it has gone."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        return float(fields["VmRSS"].split()[0]) / 1024, float(fields["VmHWM"].split()[0]) / 1024
    except (OSError, KeyError, ValueError):
        return None


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of a process (0 once it has gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS
    except (OSError, IndexError, ValueError):
        return 0.0


def kind_of(pid: int) -> str:
    """coordinator, worker (fl-bench host), agent (fl-bench device), broker (mosquitto) or other."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "other"
    for marker, kind in (("bench host", "worker"), ("bench device", "agent"), ("mosquitto", "broker")):
        if marker in command:
            return kind
    return "coordinator" if "bench simulate" in command else "other"


def stamp(line: str) -> float | None:
    """The wall-clock time a log line was written, or None for a line without one."""
    match = STAMP.match(line)
    return datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if match else None


def round_phases(log_file: Path, rounds: int) -> list[dict]:
    """Per round, from the coordinator's log: announcement to first accepted update, first to last, last to close."""
    marks: dict[int, dict[str, float]] = {r: {} for r in range(1, rounds + 1)}
    patterns = {
        "announced": re.compile(r"round announced round=(\d+) .*final=False"),
        "accepted": re.compile(r"update accepted device=\S+ round=(\d+)"),
        "closed": re.compile(r"round closed round=(\d+)"),
    }
    for line in log_file.read_text(errors="replace").splitlines():
        for name, pattern in patterns.items():
            found = pattern.search(line)
            when = stamp(line)
            if found and when is not None and int(found.group(1)) in marks:
                mark = marks[int(found.group(1))]
                mark.setdefault(name if name != "accepted" else "first", when)
                if name == "accepted":
                    mark["last"] = when
    return [
        {
            "round": r,
            "announce_to_first_update_s": round(m["first"] - m["announced"], 2),
            "first_to_last_update_s": round(m["last"] - m["first"], 2),
            "last_update_to_close_s": round(m["closed"] - m["last"], 2),
        }
        for r, m in marks.items()
        if {"announced", "first", "last", "closed"} <= m.keys()
    ]


def simulate_command(devices: int, rounds: int, run_dir: Path, extra: list[str]) -> list[str]:
    """The bench: pools of 50, 5 labels per acquisition, 1 epoch, no per-device evaluation, the embedded broker."""
    return [
        *(sys.executable, "-m", "bench", "simulate", "--devices", str(devices), "--rounds", str(rounds)),
        *("--pool-size", "50", "--labels-per-acquisition", "5", "--epochs", "1", "--no-device-eval"),
        *("--init-samples", "100", "--init-epochs", "1", "--validation-samples", "200", "--test-samples", "1000"),
        *("--partition", "iid", "--json", "--log-level", "info", "--run-dir", str(run_dir), *extra),
    ]


def by_kind(processes: Iterable[ProcessPeak]) -> dict[str, dict[str, float]]:
    """Per kind of process: how many, the sum of their own peaks (VmHWM) and of their CPU seconds."""
    kinds: dict[str, dict[str, float]] = {}
    for seen in processes:
        kind = kinds.setdefault(seen.kind, {"processes": 0, "hwm_mb_sum": 0.0, "cpu_seconds": 0.0})
        kind["processes"] += 1
        kind["hwm_mb_sum"] = round(kind["hwm_mb_sum"] + seen.hwm_mb, 1)
        kind["cpu_seconds"] = round(kind["cpu_seconds"] + seen.cpu_seconds, 1)
    return kinds


def run_sampled(command: list[str], log_file: Path, cwd: Path | None = None) -> tuple[bytes, int, TreeSampler]:
    """Runs a command (its stderr to log_file; in `cwd`, whose code `python -m` then runs) while sampling its process
    tree; (stdout, exit code, the sampler)."""
    with open(log_file, "wb") as log_stream:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log_stream, cwd=cwd)
        sampler = TreeSampler(process.pid)
        thread = threading.Thread(target=sampler.run, daemon=True)
        thread.start()
        output, _ = process.communicate()
        sampler.stop.set()
        thread.join()
    return output, process.returncode, sampler


def measure(devices: int, rounds: int, folder: Path, extra: list[str]) -> dict:
    """Runs one bench while sampling its process tree; its rounds, phases, updates, CPU and memory."""
    log_file = folder / "simulate.log"
    started = time.monotonic()
    output, code, sampler = run_sampled(simulate_command(devices, rounds, folder / "run", extra), log_file)
    lines = [json.loads(line) for line in output.decode().splitlines() if line.startswith("{")]
    results = [line for line in lines if "round" in line]
    return {
        "devices": devices,
        "mode": "process-per-device" if "--process-per-device" in extra else "virtual",
        "exit_code": code,
        "wall_seconds": round(time.monotonic() - started, 1),
        "rounds_completed": len(results),
        "round_seconds": [r["seconds"] for r in results],
        "round_accuracy": [r["accuracy"] for r in results],
        "updates_accepted": [len(r["divergence"]) for r in results],
        "updates_rejected": [len(r["rejected"]) for r in results],
        "round_phases": round_phases(log_file, rounds),
        "processes": by_kind(sampler.processes.values()),
        "peak_total_rss_mb": round(sampler.peak_total_rss_mb, 1),
        "sum_of_process_peaks_mb": round(sum(p.hwm_mb for p in sampler.processes.values()), 1),
    }


def main() -> int:
    """Runs the baseline (one process per device, few devices) and the virtual fleet; prints one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--baseline-devices", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bound-mb", type=float, default=8192.0, help="total peak RSS allowed (8 GB)")
    parser.add_argument("--out", type=Path, help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="virtual-fleet-"))
    baseline_dir, virtual_dir = root / "baseline", root / "virtual"
    baseline_dir.mkdir(parents=True, exist_ok=True)
    virtual_dir.mkdir(parents=True, exist_ok=True)
    baseline = measure(args.baseline_devices, args.rounds, baseline_dir, ["--process-per-device"])
    virtual = measure(args.devices, args.rounds, virtual_dir, [])
    agents = baseline["processes"].get("agent", {"hwm_mb_sum": 0.0})
    per_agent = agents["hwm_mb_sum"] / max(1, args.baseline_devices)
    virtual_devices_mb = sum(virtual["processes"].get(k, {}).get("hwm_mb_sum", 0.0) for k in ("worker",))
    report = {
        "machine": {"cores": os.cpu_count()},
        "baseline": baseline,
        "virtual": virtual,
        "memory_per_device_mb": {
            "process_per_device": round(per_agent, 1),
            "virtual": round(virtual_devices_mb / max(1, args.devices), 2),
            "ratio": round(per_agent / max(1e-9, virtual_devices_mb / max(1, args.devices)), 1),
        },
        "process_per_device_at_n_estimate_mb": round(per_agent * args.devices, 0),
        "bound_mb": args.bound_mb,
        "within_bound": virtual["sum_of_process_peaks_mb"] <= args.bound_mb,
        "all_rounds_completed": virtual["rounds_completed"] == args.rounds,
        "every_update_accepted": all(n == args.devices for n in virtual["updates_accepted"])
        and not any(virtual["updates_rejected"]),
        "runs": str(root),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
