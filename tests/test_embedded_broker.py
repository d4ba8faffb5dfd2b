# The embedded broker answers on its own port or says it could not: another process's listener there is not it.
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordinator.fleet.broker import BrokerError, EmbeddedBroker, free_loopback_port, listener_owned


def test_a_port_another_process_listens_on_is_a_clear_error_not_someone_elses_broker(tmp_path: Path) -> None:
    """Two brokers on one machine can draw the same free port (two test workers, or a restart on its old port after
    another took it): a connect then succeeds to the other listener, and the broker used to report itself started."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(BrokerError, match=f"port {port}"):
            EmbeddedBroker(tmp_path / "broker", port=port).start(timeout=5)
        assert time.monotonic() - started < 5  # mosquitto's exit says so at once, not the timeout


def test_listener_ownership_is_read_per_process(tmp_path: Path) -> None:
    """The check behind it: a listener belongs to the process whose descriptors hold its socket."""
    with socket.socket() as mine:
        mine.bind(("127.0.0.1", 0))
        mine.listen()
        port = mine.getsockname()[1]
        assert listener_owned(os.getpid(), port) is True
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            assert listener_owned(other.pid, port) is False
        finally:
            other.kill()
            other.wait()
    with EmbeddedBroker(tmp_path / "broker", port=free_loopback_port()) as broker:
        assert broker._process is not None
        assert listener_owned(broker._process.pid, broker.port) is True
