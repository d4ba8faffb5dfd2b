# Shared fixtures: a private mosquitto per test (or per module), a tmpfs, Fashion-MNIST once per module, process
# cleanup.
from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fleet import WAIT, stop_all
from tmpfs import mounted_tmpfs

from coordinator.fleet.broker import EmbeddedBroker, free_loopback_port
from edge_agent.data.fashion_mnist import load_fashion_mnist
from edge_agent.data.image_arrays import ImageDataset
from protocol.mqtt import BrokerAddress, MqttSession

# Every process a test starts inherits it: a child that dies of a signal (SIGSEGV, SIGABRT) writes each thread's
# Python traceback into its log, which the failing test prints.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


REAL_PARTS = {"broker", "module_broker", "processes"}  # the fixtures of tests that run brokers and processes


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules with tests of real processes and brokers (the long ones) first, each module's tests together and
    in order: two workers then share out the long tests early and end on short ones, instead of one worker finishing
    a long test while the other waits."""
    heavy = {
        getattr(item, "module", None)
        for item in items
        if item.get_closest_marker("integration") is not None or REAL_PARTS & set(getattr(item, "fixturenames", ()))
    }
    items.sort(key=lambda item: getattr(item, "module", None) not in heavy)


@pytest.fixture(autouse=True)
def restored_logging() -> Iterator[None]:
    """A command line run in-process (`main([...])`) points the root logger at that test's captured stderr and sets
    its level: put both back after every test, so no later test logs to a closed stream or sees other levels."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers, root.level = handlers, level


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs for one test (skipped where mounting is not permitted)."""
    with mounted_tmpfs(tmp_path / "tmpfs") as folder:
        yield folder


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[EmbeddedBroker]:
    """A private mosquitto for this test on a free loopback port it keeps, so a test can restart it there."""
    with EmbeddedBroker(tmp_path / "broker", port=free_loopback_port()) as embedded:
        yield embedded


@pytest.fixture(scope="module")
def module_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    """One mosquitto for a module's tests (each test its own fleet)."""
    with EmbeddedBroker(tmp_path_factory.mktemp("broker")) as embedded:
        yield embedded


@pytest.fixture(scope="module")
def fashion() -> ImageDataset:
    """The Fashion-MNIST files, read once per module."""
    return load_fashion_mnist()


@pytest.fixture
def processes() -> Iterator[list]:
    """Every process a test starts; whatever is still running at the end is killed."""
    started: list = []
    yield started
    stop_all(started)


@pytest.fixture
def sessions():
    """Opens sessions and closes every one of them after the test."""
    opened: list[MqttSession] = []

    def open_session(address: BrokerAddress, client_id: str, **options) -> MqttSession:
        session = MqttSession(address, client_id=client_id, **options)
        session.connect(timeout=WAIT)
        opened.append(session)
        return session

    yield open_session
    for session in opened:
        session.close()
