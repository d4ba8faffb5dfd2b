# Privacy loaded when asked for: a plain run's coordinator process never imports dp_accounting or cryptography; a
# private run's does (the probe can tell). Real coordinator processes behind a real mosquitto, one fake device.
from __future__ import annotations

from pathlib import Path

import pytest
from fleet import FakeDevice, log_text, perturbed, start_coordinator, stop_all, wait_exit

from coordinator.fleet.broker import EmbeddedBroker
from protocol import wire

pytestmark = pytest.mark.integration

# `python -m coordinator ...` that prints, as the process exits, which privacy libraries it imported.
PRIVACY_PROBE = """
import atexit, runpy, sys
def report():
    loaded = sorted(name for name in ("dp_accounting", "cryptography") if name in sys.modules)
    print("privacy libraries loaded:", loaded, flush=True)
atexit.register(report)
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize(
    ("options", "loaded"),
    [([], "[]"), (["--dp", "central", "--dp-noise-multiplier", "1.0"], "['dp_accounting']")],
    ids=["plain", "central-dp"],
)
def test_a_run_imports_the_privacy_libraries_only_when_it_asks_for_privacy(
    tmp_path: Path, options: list[str], loaded: str
) -> None:
    run_dir = tmp_path / "run"
    with EmbeddedBroker(tmp_path / "broker") as broker:
        coordinator = start_coordinator(
            broker.address, run_dir, "plain", "--rounds", "1", "--quorum", "1", *options, prelude=PRIVACY_PROBE
        )
        device = FakeDevice(broker.address, "plain", "dev-a")
        device.announce_online()  # a private round waits for a device online to draw its sample from
        try:
            announcement, base = device.current_round()
            device.publish(wire.encode(device.update(announcement, perturbed(base, seed=1))))
            assert device.acks(1)[0].accepted
            assert wait_exit(coordinator, "coordinator") == 0
        finally:
            device.close()
            stop_all([coordinator])
    assert f"privacy libraries loaded: {loaded}\n" in log_text(run_dir / "coordinator.log")
