# What a person watches while rounds run: each round's line (or JSON), the closing summary, the live dashboard.
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from coordinator.dashboard.live import LiveState
from coordinator.dashboard.server import Dashboard, dashboard_token, parse_listen_address, served_names
from coordinator.intake.observer import RoundResult
from coordinator.setup.settings import ServerSettings
from coordinator.strategies.pooled_head import pool_refinement
from protocol.errors import UsageError


class RoundPrinter:
    """Prints each round as it closes (a JSON line, or a human progress line) and the summary at the end."""

    def __init__(self, as_json: bool, total_rounds: int) -> None:
        self.as_json = as_json
        self.total_rounds = total_rounds
        self.results: list[RoundResult] = []
        self.started = time.monotonic()

    def __call__(self, result: RoundResult) -> None:
        self.results.append(result)
        devices = sorted(result.device_accuracy)
        if self.as_json:
            print(
                json.dumps(
                    {
                        "round": result.round_id,
                        "accuracy": result.accuracy,
                        "test_images": result.test_images,
                        "field_accuracy": result.field_accuracy if result.field_images else None,
                        "field_images": result.field_images,
                        "device_accuracy": [result.device_accuracy[d] for d in devices],
                        "devices": devices,
                        "labels": result.labels,
                        "server_labels": result.server_labels,
                        "peak_rss_mb": result.peak_rss_mb,
                        "divergence": {d: list(layers.values()) for d, layers in sorted(result.divergence.items())},
                        "seconds": round(result.seconds, 3),
                        "rejected": result.rejected,
                        "suspects": result.suspects,
                        **({"epsilon": result.report["dp"]["epsilon"]} if "dp" in result.report else {}),
                        **({"pool_weight": weight} if (weight := pool_refinement(result.report)) is not None else {}),
                    }
                ),
                flush=True,
            )
        else:
            local = " ".join(f"{result.device_accuracy[d]:.3f}" for d in devices)
            print(
                f"round {result.round_id:>3}/{self.total_rounds}  global acc {result.accuracy:.4f}"
                f"{test_set_words(result)}  devices [{local}]  labels {labels_words(result)}  {result.seconds:.1f}s"
                + peak_words(result.peak_rss_mb)
                + (f"  rejected {len(result.rejected)}" if result.rejected else "")
                + (f"  suspects {','.join(sorted(result.suspects))}" if result.suspects else "")
                + (f"  epsilon {result.report['dp']['epsilon']:.3g}" if "dp" in result.report else "")
                + pool_words(result.report),
                flush=True,
            )

    def say(self, line: str) -> None:
        """A start-up line: on stdout for a person, on stderr under --json (stdout stays one JSON object a line)."""
        print(line, file=sys.stderr if self.as_json else sys.stdout, flush=True)

    def summary(self, run_dir: Path, report: Path | None = None) -> None:
        """The closing line (JSON) or table (human), naming the run's HTML report when one was written."""
        if not self.results:
            return
        last = self.results[-1]
        summary = {
            "final_accuracy": last.accuracy,
            "best_device_accuracy": max(last.device_accuracy.values(), default=None),
            "rounds": len(self.results),
            "labels": last.labels,
            "seconds": round(time.monotonic() - self.started, 3),
            "run_dir": str(run_dir),
            "report": None if report is None else str(report),
        }
        if self.as_json:
            print(json.dumps({"summary": summary}), flush=True)
            return
        devices = sorted({d for r in self.results for d in r.device_accuracy})
        print()
        print("round  global  " + "  ".join(f"{d:>7}" for d in devices) + "   labels  seconds")
        for r in self.results:
            cells = "  ".join(f"{r.device_accuracy[d]:7.4f}" if d in r.device_accuracy else "      -" for d in devices)
            print(f"{r.round_id:>5}  {r.accuracy:.4f}  {cells}  {r.labels:>7}  {r.seconds:7.1f}")
        print(
            f"\nfinal global accuracy {summary['final_accuracy']:.4f}; {summary['labels']} labels; "
            f"{summary['seconds']:.0f}s; run stored in {run_dir}"
        )
        if report is not None:
            print(f"report: {report}")


def test_set_words(result: RoundResult) -> str:
    """The sizes of the test sets the round's model was measured on: the server's test images, and the field set's
    accuracy and images once it holds any."""
    field = f"  field acc {result.field_accuracy:.4f} ({result.field_images} images)" if result.field_images else ""
    return f" ({result.test_images} test images){field}"


def labels_words(result: RoundResult) -> str:
    """The round's label count, the server's and the devices' shown apart."""
    return f"{result.labels} (server {result.server_labels} + devices {result.labels - result.server_labels})"


def pool_words(report: dict) -> str:
    """'  refined by the pools (weight W)' for a round whose class means the pools' posteriors moved (the pooled
    head's --pool-statistics 1), W their weight against all the fit's labels; '' otherwise."""
    weight = pool_refinement(report)
    return "" if weight is None else f"  refined by the pools (weight {weight:.2f})"


def peak_words(peaks: dict[str, float]) -> str:
    """The largest device peak RSS of the round and whose it is ('' when no device reported one)."""
    if not peaks:
        return ""
    device = max(sorted(peaks), key=peaks.__getitem__)
    return f"  peak RSS {peaks[device]:.0f} MB ({device})"


@contextlib.contextmanager
def dashboard_for(args: argparse.Namespace, settings: ServerSettings) -> Iterator[LiveState | None]:
    """The live state of a dashboard served for the run's duration if --dashboard asks for one, else None."""
    with dashboard_of(args, settings) as dashboard:
        yield None if dashboard is None else dashboard.server.live


@contextlib.contextmanager
def dashboard_of(args: argparse.Namespace, settings: ServerSettings) -> Iterator[Dashboard | None]:
    """The dashboard served for the run's duration (with its live state) if --dashboard asks for one, else None."""
    if args.dashboard is None:
        if args.dashboard_token is not None:
            raise UsageError("--dashboard-token needs --dashboard")
        if args.dashboard_host:
            raise UsageError("--dashboard-host needs --dashboard")
        yield None
        return
    address = parse_listen_address(args.dashboard)
    token = dashboard_token(address, args.dashboard_token, settings.run_dir)
    live = LiveState(settings.policy.rounds)
    with Dashboard(address, settings.run_dir, live, token, hosts=served_names(args.dashboard_host)) as dashboard:
        where = f"{dashboard.url}#token={token}" if token and args.dashboard_token is None else dashboard.url
        print(f"dashboard at {where}", file=sys.stderr, flush=True)
        yield dashboard
