# Topic patterns: the strings on the wire, build/match round trips, foreign topics, identifiers refused, the router.
from __future__ import annotations

import pytest

from protocol import topics, wire
from protocol.topics import CHUNKS, Router, Topic

HASH = "ab" * 32
BAD_IDENTIFIERS = ["a/b", "dev+", "dev#", "#", "+", "", "a" * 65, "dev 1", "dév", "dev\n", "{device}", None]


def test_the_topic_strings_on_the_wire_are_unchanged() -> None:
    assert topics.ROUND.build(fleet="fleet-1") == "fl/fleet-1/round"
    assert topics.MODEL.build(fleet="fleet-1", hash="abc123") == "fl/fleet-1/model/abc123"
    assert topics.BUNDLE.build(fleet="fleet-1", hash="abc123") == "fl/fleet-1/bundle/abc123"
    assert topics.ENCODER.build(fleet="fleet-1", hash=HASH) == f"fl/fleet-1/encoder/{HASH}"
    assert topics.UPDATE.build(fleet="fleet-1", device="dev_7.a") == "fl/fleet-1/devices/dev_7.a/update"
    assert topics.ACK.build(fleet="fleet-1", device="dev_7.a") == "fl/fleet-1/devices/dev_7.a/ack"
    assert topics.STATUS.build(fleet="fleet-1", device="dev_7.a") == "fl/fleet-1/devices/dev_7.a/status"
    assert topics.STATUS.filter(fleet="fleet-1") == "fl/fleet-1/devices/+/status"
    assert topics.UPDATE.filter() == "fl/+/devices/+/update"
    assert CHUNKS.build("fl/f/round", 7) == "fl/f/round/chunk/7"


@pytest.mark.parametrize(
    ("pattern", "values"),
    [
        (topics.ROUND, {"fleet": "f"}),
        (topics.MODEL, {"fleet": "f", "hash": HASH}),
        (topics.BUNDLE, {"fleet": "F.1", "hash": HASH}),
        (topics.ENCODER, {"fleet": "f", "hash": HASH}),
        (topics.UPDATE, {"fleet": "f", "device": "Dev-42.x_y"}),
        (topics.ACK, {"fleet": "f", "device": "d"}),
        (topics.STATUS, {"fleet": "f", "device": "a" * 64}),
    ],
)
def test_a_built_topic_matches_its_pattern_with_the_same_parameters(pattern: Topic, values: dict[str, str]) -> None:
    topic = pattern.build(**values)
    assert pattern.match(topic) == values
    assert pattern.bind(fleet=values["fleet"]).match(topic) == {k: v for k, v in values.items() if k != "fleet"}
    assert pattern.bind(fleet="other").match(topic) is None


@pytest.mark.parametrize(
    "topic",
    [
        "fl/f/round",
        "fl/f/devices/d",
        "fl/f/devices/d/update/extra",
        "fl/f/devices/d/update/chunk/0",
        "xx/f/devices/d/update",
        "fl/f/nodes/d/update",
        "fl/f/devices/+/update",
        "fl/f/devices/#/update",
        "fl/f/devices//update",
        "fl/f/devices/d/status",
        "",
    ],
)
def test_other_topics_do_not_match(topic: str) -> None:
    assert topics.UPDATE.match(topic) is None


@pytest.mark.parametrize("bad", BAD_IDENTIFIERS)
def test_a_parameter_that_is_not_an_identifier_is_refused(bad: str) -> None:
    for build in (
        lambda: topics.ROUND.build(fleet=bad),
        lambda: topics.MODEL.build(fleet=bad, hash="h"),
        lambda: topics.MODEL.build(fleet="f", hash=bad),
        lambda: topics.UPDATE.build(fleet="f", device=bad),
        lambda: topics.UPDATE.build(fleet=bad, device="dev"),
        lambda: topics.STATUS.filter(fleet=bad),
        lambda: topics.ACK.bind(device=bad),
    ):
        with pytest.raises(wire.WireError, match="must be 1 to 64"):
            build()
    if isinstance(bad, str) and "/" not in bad:
        assert topics.UPDATE.match(f"fl/f/devices/{bad}/update") is None


def test_parameters_must_be_the_patterns_own() -> None:
    with pytest.raises(TypeError, match="needs device"):
        topics.ACK.build(fleet="f")
    with pytest.raises(TypeError, match="no parameter hash"):
        topics.ACK.build(fleet="f", device="d", hash="h")


@pytest.mark.parametrize(
    ("topic", "parsed"),
    [
        ("fl/f/model/abc/chunk/0", ("fl/f/model/abc", 0)),
        ("fl/f/devices/d/update/chunk/65535", ("fl/f/devices/d/update", 65535)),
        ("fl/f/devices/d/update/chunk/01", ("fl/f/devices/d/update", None)),
        ("fl/f/devices/d/update/chunk/x", ("fl/f/devices/d/update", None)),
        ("fl/f/devices/d/update", None),
        ("chunk/0", None),
        ("fl/f/chunk/0/more", None),
    ],
)
def test_chunk_topics_name_their_message_and_index(topic: str, parsed: tuple[str, int | None] | None) -> None:
    assert CHUNKS.match(topic) == parsed


def test_a_subscription_also_takes_its_chunks_unless_it_covers_them() -> None:
    assert CHUNKS.with_chunks("fl/f/devices/+/update") == ["fl/f/devices/+/update", "fl/f/devices/+/update/chunk/+"]
    assert CHUNKS.with_chunks("fl/f/#") == ["fl/f/#"]


def test_the_device_acl_comes_from_the_patterns() -> None:
    assert topics.device_acl("f") == [
        "pattern write fl/f/devices/%u/#",
        "pattern read fl/f/devices/%u/ack",
        "pattern read fl/f/devices/%u/ack/chunk/+",
        "pattern read fl/f/devices/%u/secagg_in",
        "pattern read fl/f/devices/%u/secagg_in/chunk/+",
        "pattern read fl/f/devices/%u/labelling_in",
        "pattern read fl/f/devices/%u/labelling_in/chunk/+",
        "pattern read fl/f/round",
        "pattern read fl/f/round/chunk/+",
        "pattern read fl/f/serving",
        "pattern read fl/f/serving/chunk/+",
        "pattern read fl/f/model/#",
        "pattern read fl/f/bundle/#",
        "pattern read fl/f/backbone/#",
        "pattern read fl/f/encoder/#",
    ]
    assert topics.FLEET_ALL.acl(fleet="f") == "fl/f/#"
    with pytest.raises(wire.WireError):
        topics.device_acl("f/#")


def test_the_router_hands_a_topic_to_its_first_matching_pattern_with_its_parameters() -> None:
    router: Router[str] = Router()
    router.add(topics.UPDATE.bind(fleet="f"), "update")
    router.add(topics.STATUS.bind(fleet="f"), "status")
    router.add(topics.MODEL.bind(fleet="f"), "model", subscribed=False)
    assert router.route("fl/f/devices/d-1/update") == ("update", {"device": "d-1"})
    assert router.route("fl/f/devices/d-1/status") == ("status", {"device": "d-1"})
    assert router.route(f"fl/f/model/{HASH}") == ("model", {"hash": HASH})
    assert router.route("fl/g/devices/d-1/update") is None
    assert router.route("fl/f/devices/d-1/ack") is None
    assert list(router.filters()) == ["fl/f/devices/+/update", "fl/f/devices/+/status"]
