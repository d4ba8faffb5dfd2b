# Every MQTT topic of the runtime as a pattern that builds, matches and subscribes; chunk topics; one topic router.
from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from protocol.wire import IDENTIFIER, check_identifier

Parameters = dict[str, str]
H = TypeVar("H")

PARAMETER = re.compile(r"^\{([a-z_]+)\}$")
# What an identifier check calls each parameter in its error.
LABELS = {"fleet": "fleet", "device": "device id", "hash": "hash", "leaf": "leaf", "prefix": "discovery prefix"}
SINGLE_LEVEL = "+"
MULTI_LEVEL = "#"
# mosquitto's ACL stand-in for the connected client's username (a device's login is its device id).
ACL_USERNAME = "%u"
CHUNK_LEVEL = "chunk"
CHUNK_INDEX = re.compile(r"^(0|[1-9][0-9]{0,5})$")


@dataclass(frozen=True)
class Topic:
    """A topic pattern such as fl/{fleet}/devices/{device}/update: `build` fills every parameter (each a checked
    identifier, so no value can add a level or a wildcard), `match` reads them back from an incoming topic, `filter`
    is the subscription with the parameters left open as '+', and `bind` fixes some of them (a fleet, a device)."""

    template: str

    @property
    def levels(self) -> list[str]:
        """The pattern's levels, parameters written {name}."""
        return self.template.split("/")

    @property
    def parameters(self) -> list[str]:
        """The names of the parameters still open, in order."""
        return [found.group(1) for found in map(PARAMETER.fullmatch, self.levels) if found]

    def bind(self, **values: str) -> Topic:
        """This pattern with the given parameters fixed (a WireError for a value that is not an identifier)."""
        unknown = sorted(set(values) - set(self.parameters))
        if unknown:
            raise TypeError(f"topic {self.template} has no parameter {', '.join(unknown)}")
        return Topic("/".join(self._level(level, values) for level in self.levels))

    def build(self, **values: str) -> str:
        """The concrete topic for these parameter values (all of them given)."""
        missing = sorted(set(self.parameters) - set(values))
        if missing:
            raise TypeError(f"topic {self.template} needs {', '.join(missing)}")
        return self.bind(**values).template

    def filter(self, **values: str) -> str:
        """The subscription filter for these parameter values, the parameters not given matching any level ('+')."""
        levels = self.bind(**values).levels
        return "/".join(SINGLE_LEVEL if PARAMETER.fullmatch(level) else level for level in levels)

    def match(self, topic: str) -> Parameters | None:
        """The parameter values of a topic of this pattern (each a valid identifier); None for any other topic."""
        levels = topic.split("/")
        if len(levels) != len(self.levels):
            return None
        values: Parameters = {}
        for pattern, level in zip(self.levels, levels):
            found = PARAMETER.fullmatch(pattern)
            if found is None and pattern != level:
                return None
            if found is not None:
                if not is_identifier(level):
                    return None
                values[found.group(1)] = level
        return values

    def acl(self, **values: str) -> str:
        """This pattern as a mosquitto ACL pattern: the device level is the client's username (%u), another open
        parameter any level ('+', or '#' as the last level: a content hash and the chunks below it)."""
        bound = self.bind(**values)
        levels = [_acl_level(level, index == len(bound.levels) - 1) for index, level in enumerate(bound.levels)]
        return "/".join(levels)

    def _level(self, level: str, values: dict[str, str]) -> str:
        found = PARAMETER.fullmatch(level)
        if found is None or found.group(1) not in values:
            return level
        name = found.group(1)
        return check_identifier(LABELS.get(name, name), values[name])


def _acl_level(level: str, last: bool) -> str:
    """One level of an ACL pattern (see Topic.acl)."""
    found = PARAMETER.fullmatch(level)
    if found is None:
        return level
    if found.group(1) == "device":
        return ACL_USERNAME
    return MULTI_LEVEL if last else SINGLE_LEVEL


def is_identifier(level: str) -> bool:
    """Whether a topic level is a valid identifier (what `build` accepts for a parameter)."""
    return IDENTIFIER.fullmatch(level) is not None


ROUND = Topic("fl/{fleet}/round")  # retained: the current round announcement
MODEL = Topic("fl/{fleet}/model/{hash}")  # retained: global weights, addressed by their hash
BUNDLE = Topic("fl/{fleet}/bundle/{hash}")  # retained: the ONNX bundle of the global model with this hash
BACKBONE = Topic("fl/{fleet}/backbone/{hash}")  # retained: one graph of a frozen prefix, by its sha256
ENCODER = Topic("fl/{fleet}/encoder/{hash}")  # retained: frozen-encoder ONNX bytes (FAST), by their sha256
SERVING = Topic("fl/{fleet}/serving")  # retained: the serving version (the model devices predict with)
UPDATE = Topic("fl/{fleet}/devices/{device}/update")  # a device's update for a round
ACK = Topic("fl/{fleet}/devices/{device}/ack")  # the coordinator's answer to one device's update
STATUS = Topic("fl/{fleet}/devices/{device}/status")  # retained: a device's presence and progress
SECAGG_UP = Topic("fl/{fleet}/devices/{device}/secagg")  # a device's secure-aggregation stage messages
SECAGG_DOWN = Topic("fl/{fleet}/devices/{device}/secagg_in")  # the coordinator's stage messages to one device
PREDICTIONS = Topic("fl/{fleet}/devices/{device}/predictions")  # a device's predictions, batched, when the fleet asks
# a relay's site devices' prediction batches, passed on upstream under the relay's own topics (each names its device)
RELAYED_PREDICTIONS = Topic("fl/{fleet}/devices/{device}/relayed_predictions")
LABEL_QUERIES = Topic("fl/{fleet}/devices/{device}/queries")  # central labelling: a device's query images, chunked
# central labelling's two conversations beside the queries, named as secure aggregation's are: what a device says to
# the desk (its receipts of answers and corrections, answers given on the device) and what the desk says to one
# device (its receipts of queries, people's answers and corrections)
LABELLING_UP = Topic("fl/{fleet}/devices/{device}/labelling")
LABELLING_DOWN = Topic("fl/{fleet}/devices/{device}/labelling_in")
DEVICE_OWN = Topic("fl/{fleet}/devices/{device}/{leaf}")  # any topic of one device: what it may write
FLEET_ALL = Topic("fl/{fleet}/{rest}")  # any topic of one fleet: what its coordinator may read and write
# The Home Assistant bridge (fl-coordinator ha-bridge), outside the fleet's fl/ tree: JSON for tools that read JSON.
HA_DISCOVERY_PREFIX = "homeassistant"  # Home Assistant's default MQTT discovery prefix
HA_DISCOVERY = Topic("{prefix}/sensor/{node}/{object}/config")  # retained: one camera's HA MQTT discovery config
HA_STATE = Topic("edge-fal/{fleet}/{device}/state")  # retained: a device's latest prediction as JSON
HA_AVAILABILITY = Topic("edge-fal/{fleet}/{device}/availability")  # retained: "online" or "offline", from its status
HA_BRIDGE = Topic("edge-fal/{fleet}/bridge")  # retained: the bridge's own "online", "offline" its last will
HA_FLEET_ALL = Topic("edge-fal/{fleet}/{rest}")  # everything the bridge publishes for one fleet: what its readers read


@dataclass(frozen=True)
class ChunkTopic:
    """Where the numbered chunks of a message too large for the broker travel: <topic>/chunk/<index>."""

    level: str = CHUNK_LEVEL

    def build(self, topic: str, index: int) -> str:
        """Where chunk `index` of a message for `topic` is published."""
        return f"{topic}/{self.level}/{index}"

    def match(self, topic: str) -> tuple[str, int | None] | None:
        """(the message's own topic, the chunk index or None if that level is not one) for a chunk topic; None for
        any other topic."""
        base, separator, index = topic.rpartition(f"/{self.level}/")
        if not separator or not base or "/" in index:
            return None
        return base, int(index) if CHUNK_INDEX.fullmatch(index) else None

    def filter(self, topic_filter: str) -> str | None:
        """The subscription that brings the chunks of messages matching `topic_filter` (None: it already does)."""
        return None if topic_filter.endswith(MULTI_LEVEL) else f"{topic_filter}/{self.level}/{SINGLE_LEVEL}"

    def with_chunks(self, topic_filter: str) -> list[str]:
        """The filters a subscription to `topic_filter` needs: itself and, unless it already covers them, its chunks."""
        extra = self.filter(topic_filter)
        return [topic_filter] if extra is None else [topic_filter, extra]


CHUNKS = ChunkTopic()


def device_acl(fleet: str) -> list[str]:
    """The mosquitto ACL lines of a fleet's devices: each writes only under its own topics and reads only the
    round, the serving version, the models, their bundles and backbones, the encoders, its own acks, its own
    secure-aggregation messages and the labelling desk's word to it (each with the chunks a large message takes)."""
    readable = (ACK, SECAGG_DOWN, LABELLING_DOWN, ROUND, SERVING, MODEL, BUNDLE, BACKBONE, ENCODER)
    reads = [name for pattern in readable for name in CHUNKS.with_chunks(pattern.acl(fleet=fleet))]
    return [f"pattern write {DEVICE_OWN.acl(fleet=fleet)}", *(f"pattern read {name}" for name in reads)]


def labelling_acl(fleet: str) -> list[str]:
    """The mosquitto ACL topic lines of a fleet's labelling desk (its own login: least privilege): it reads every
    device's queries and its word to the desk, and writes the desk's word to every device (each with its chunks),
    nothing else."""
    reads = (LABEL_QUERIES, LABELLING_UP)
    return [
        *(f"topic read {pattern.filter(fleet=fleet)}/{MULTI_LEVEL}" for pattern in reads),
        f"topic write {LABELLING_DOWN.filter(fleet=fleet)}/{MULTI_LEVEL}",
    ]


def ha_bridge_acl(fleet: str, discovery_prefix: str = HA_DISCOVERY_PREFIX) -> list[str]:
    """The mosquitto ACL topic lines of a fleet's Home Assistant bridge (its own login): it reads every device's
    status and predictions and every relay's relayed predictions (each with its chunks) and writes the cameras' discovery configs, states and availability
    and its own availability, nothing else."""
    heard = (STATUS, PREDICTIONS, RELAYED_PREDICTIONS)
    reads = [name for pattern in heard for name in CHUNKS.with_chunks(pattern.filter(fleet=fleet))]
    return [
        *(f"topic read {name}" for name in reads),
        *(f"topic write {name}" for name in _ha_topics(fleet, discovery_prefix)),
    ]


def home_assistant_acl(fleet: str, discovery_prefix: str = HA_DISCOVERY_PREFIX) -> list[str]:
    """The mosquitto ACL topic lines of Home Assistant's (or Node-RED's) login on a fleet's broker: it reads its
    discovery prefix (it subscribes to all of it) and everything the bridge publishes for the fleet, and writes its
    birth message (<prefix>/status); nothing of the fleet's own topics."""
    return [
        f"topic read {discovery_prefix}/{MULTI_LEVEL}",
        f"topic read {HA_FLEET_ALL.acl(fleet=fleet)}",
        f"topic write {discovery_prefix}/status",
    ]


def _ha_topics(fleet: str, discovery_prefix: str) -> list[str]:
    """The filters of every topic the Home Assistant bridge publishes for a fleet."""
    discovery = HA_DISCOVERY.filter(prefix=discovery_prefix)
    return [discovery, HA_STATE.filter(fleet=fleet), HA_AVAILABILITY.filter(fleet=fleet), HA_BRIDGE.build(fleet=fleet)]


class Router(Generic[H]):
    """Topic patterns mapped to handlers: an incoming topic goes to the handler of the first pattern it matches,
    with the parameters it names. Routes marked `subscribed` give the session's subscriptions (their filters)."""

    def __init__(self) -> None:
        self.routes: list[tuple[Topic, H, bool]] = []

    def add(self, pattern: Topic, handler: H, subscribed: bool = True) -> None:
        """Routes topics of `pattern` to `handler` (`subscribed`: its filter is among this router's filters)."""
        self.routes.append((pattern, handler, subscribed))

    def route(self, topic: str) -> tuple[H, Parameters] | None:
        """The handler of the first pattern the topic matches and its parameters; None: no route takes it."""
        for pattern, handler, _ in self.routes:
            values = pattern.match(topic)
            if values is not None:
                return handler, values
        return None

    def filters(self) -> Iterator[str]:
        """The subscription filter of every subscribed route."""
        return (pattern.filter() for pattern, _, subscribed in self.routes if subscribed)
