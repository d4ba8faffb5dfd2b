# Fuzzing every message type: the decoder of each kind on the wire refuses non-finite, out-of-range and malformed
# values with a bounded WireError and nothing else, and what it lets through is finite and within its declared range;
# then a plain client sends such messages to every topic a device may write, at a real coordinator running its
# labelling desk, and to the topics a real device reads: every part stays alive, logs no traceback, and still works.
from __future__ import annotations

import dataclasses
import math
import random
import signal
import typing
from pathlib import Path
from typing import Any

import msgpack
import pytest
from browser import free_port
from fleet import FakeDevice, log_text, start_coordinator, wait_exit
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_central_labelling import asked_queries, device
from test_misbehaving_parties import PlainClient

from coordinator.fleet.broker import EmbeddedBroker
from protocol import wire
from protocol.bounds import INT_RANGE, bounds_of
from protocol.messages import WIRE_TYPES

HOSTILE_FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e300, -1e300, 3e38, -0.0, 5e-324]),
)
HOSTILE_INTS = st.one_of(
    st.integers(-(2**63), 2**64 - 1), st.sampled_from([-1, 2**63, 2**64 - 1, -(2**63)])
)  # msgpack's range
SCALARS = st.one_of(st.none(), st.booleans(), HOSTILE_INTS, HOSTILE_FLOATS, st.text(max_size=8), st.binary(max_size=8))
HOSTILE = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12,
)
SHAPED: dict[Any, st.SearchStrategy] = {
    bool: st.booleans(),
    int: HOSTILE_INTS,
    float: HOSTILE_FLOATS,
    str: st.text(max_size=12),
    bytes: st.binary(max_size=16),
    list[int]: st.lists(HOSTILE_INTS, max_size=4),
    list[float]: st.lists(HOSTILE_FLOATS, max_size=4),
    list[str]: st.lists(st.text(max_size=8), max_size=4),
    list[bytes]: st.lists(st.binary(max_size=8), max_size=4),
    dict[str, float]: st.dictionaries(st.text(max_size=6), HOSTILE_FLOATS, max_size=4),
}


@st.composite
def envelopes(draw: st.DrawFn, cls: type) -> bytes:
    """An envelope of a message kind whose every field is a value of its type (hostile numbers) or of any shape, or
    missing, plus now and then a field the kind does not have."""
    hints = wire.type_hints(cls)
    body: dict[str, Any] = {"v": 2, "kind": cls.KIND}
    for field in dataclasses.fields(cls):
        choice = draw(st.integers(0, 9))
        if choice == 0:
            continue
        shaped = SHAPED.get(hints[field.name])
        body[field.name] = draw(shaped if shaped is not None and choice > 2 else HOSTILE)
    if draw(st.integers(0, 9)) == 0:
        body[draw(st.text(max_size=6))] = draw(HOSTILE)
    return msgpack.packb(body, use_bin_type=True)


def assert_checked(message: Any) -> None:
    """Every number a decoded message holds is finite, fits int64 and lies within its field's declared range."""
    for field in dataclasses.fields(message):
        value = getattr(message, field.name)
        for item in value if isinstance(value, list) else value.values() if isinstance(value, dict) else [value]:
            if isinstance(item, float):
                assert math.isfinite(item), field.name
            if isinstance(item, int) and not isinstance(item, bool):
                assert INT_RANGE[0] <= item <= INT_RANGE[1], field.name
        within = bounds_of(field)
        if within is not None:
            assert within[0] <= value <= within[1], field.name


@pytest.mark.parametrize("cls", WIRE_TYPES, ids=lambda cls: cls.KIND)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_kind_refuses_bad_values_with_a_bounded_wire_error(cls: type, data: st.DataObject) -> None:
    payload = data.draw(envelopes(cls))
    try:
        message = wire.decode(payload, cls)
    except wire.WireError as error:
        assert len(str(error)) < 400, "no refusal grows with the input"
        return
    assert_checked(message)


def _example(kind: type, rng: random.Random) -> bytes:
    """One hostile envelope of a kind from a seeded random choice of values (hypothesis's `example` is not seeded)."""
    hints = wire.type_hints(kind)
    pool: dict[Any, list[Any]] = {
        float: [math.nan, math.inf, -math.inf, 1e300, 3e38, -1.0, 0.5, 1.7e9],
        int: [-1, 0, 2**63, 2**64 - 1, -(2**63), 7],
        str: ["", "..", "x" * 70, "ok"],
        bytes: [b"", b"\0" * 32],
    }
    body: dict[str, Any] = {"v": 2, "kind": kind.KIND}
    for field in dataclasses.fields(kind):
        hint = hints[field.name]
        origin = typing.get_origin(hint)
        if hint in pool:
            body[field.name] = rng.choice(pool[hint])
        elif origin is list:
            item = typing.get_args(hint)[0]
            body[field.name] = [rng.choice(pool.get(item, [None])) for _ in range(rng.randint(0, 3))]
        else:
            body[field.name] = rng.choice([{}, [], None, {"a": math.nan}])
    return msgpack.packb(body, use_bin_type=True)


DEVICE_TOPICS = ("update", "status", "predictions", "secagg", "queries", "labelling")  # what a device may write
DEVICE_READS = ("devices/cam-a/labelling_in", "devices/cam-a/ack", "devices/cam-a/secagg_in", "round", "serving")


@pytest.mark.integration
def test_a_coordinator_with_its_desk_and_a_device_survive_every_kind_on_every_topic(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    port = free_port()
    with EmbeddedBroker(tmp_path / "broker") as broker:
        coordinator = start_coordinator(
            broker.address,
            run_dir,
            "fuzz",
            *("--rounds", "1", "--quorum", "1", "--labelling", "--dashboard", f"127.0.0.1:{port}"),
        )
        state = asked_queries(tmp_path, "cam-a", 0)
        agent = device(broker, tmp_path, "cam-a")
        attacker = PlainClient(broker.port, "cam-x")
        try:
            honest = FakeDevice(broker.address, "fuzz", "dev-a")
            announcement, base = honest.current_round()
            rng = random.Random(0)
            for kind in WIRE_TYPES:
                for payload in [_example(kind, rng) for _ in range(8)]:
                    for topic in DEVICE_TOPICS:
                        attacker.send(f"fl/fuzz/devices/cam-x/{topic}", payload)
                    for topic in DEVICE_READS:
                        attacker.send(f"fl/yard/{topic}", payload)
            honest.publish(wire.encode(honest.update(announcement, base)))
            assert wait_exit(coordinator, "the coordinator's one round") == 0
            assert agent.poll() is None, "the device is alive"
            assert (state / "labelling").is_dir()
        finally:
            attacker.close()
            agent.send_signal(signal.SIGTERM)
            agent.wait(timeout=30)
            if coordinator.poll() is None:
                coordinator.kill()
                coordinator.wait(timeout=30)
        coordinator_log = log_text(run_dir / "coordinator.log")
        assert "Traceback" not in coordinator_log
        assert "labelling message refused device=cam-x" in coordinator_log and "rejected" in coordinator_log
        assert "Traceback" not in (tmp_path / "cam-a.log").read_text()
