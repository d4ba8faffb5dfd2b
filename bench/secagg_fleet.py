# A secure-aggregation round in one process: a coordinator and its devices exchange every stage message through the
# wire, and each side's bytes and compute time are counted (the tests' driver and benchmarks/secagg_cost.py's).
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from coordinator.secure.secagg_round import SecAggSettings
from coordinator.secure.secagg_server import SecAggServer
from coordinator.secure.secagg_unmask import SecAggResult
from edge_agent.loop.secagg_device import SecAggDevice
from protocol import wire
from protocol.credentials import DeviceIdentity
from protocol.messages import DeliveryAck, ShareBundle
from protocol.secagg.identity import new_identity
from protocol.tensors import Weights

ROUND = 7
RUN = "run-a"
T = TypeVar("T")


@dataclass
class Costs:
    """What a round cost: bytes each device sent and received, seconds each device and the coordinator computed."""

    sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    received: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    device_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    server_seconds: float = 0.0


def head_updates(count: int, seed: int = 0, scale: float = 0.5, features: int = 64) -> dict[str, Weights]:
    """Head-sized updates (a 10-class linear head on `features` features) with values within the clip."""
    generator = np.random.default_rng(seed)
    return {
        f"dev{i:03d}": {
            "classifier.weight": generator.uniform(-scale, scale, (10, features)).astype(np.float32),
            "classifier.bias": generator.uniform(-scale, scale, 10).astype(np.float32),
        }
        for i in range(count)
    }


def provisioned(devices: Iterable[str]) -> dict[str, DeviceIdentity]:
    """Each device's identity as `provision` writes it: its own Ed25519 secret and the fleet's roster of every
    device's public key."""
    pairs = {device: new_identity() for device in devices}
    roster = {device: public for device, (_, public) in pairs.items()}
    return {device: DeviceIdentity(secret, roster) for device, (secret, _) in pairs.items()}


@dataclass
class SecureRound:
    """A coordinator and its devices in one secure round, with the updates each device will mask."""

    server: SecAggServer
    devices: dict[str, SecAggDevice]
    updates: dict[str, Weights]
    costs: Costs = field(default_factory=Costs)

    @classmethod
    def started(cls, updates: dict[str, Weights], signed: bool = False, **settings: Any) -> SecureRound:
        """Stage 1 done: every device advertised its keys (`signed`: a provisioned fleet's, each advert signed by
        its device's identity key and checked by the coordinator and by every device that gets it in a roster)."""
        ids = sorted(updates)
        identities = provisioned(ids) if signed else {}
        roster = {device: identity.roster[device] for device, identity in identities.items()}
        config = SecAggSettings(graph_seed=b"public", identities=roster, **settings)
        server = SecAggServer.start(RUN, ROUND, ids, updates[ids[0]], config)
        secure = cls(server, {}, updates)

        def start(device: str) -> SecAggDevice:
            identity = identities.get(device)
            return SecAggDevice.start(device, ROUND, config.clip, config.dropout, run_id=RUN, identity=identity)

        secure.devices = {device: secure.on_device(device, start, device) for device in ids}
        for device, agent in secure.devices.items():
            secure.on_server(secure.server.on_keys, secure.sent(device, secure.on_device(device, agent.advert)))
        return secure

    def share(self) -> None:
        """Stage 2 done: rosters out, bundles in, deliveries out and acknowledged, complaints settled, partners out."""
        self.send_shares()
        self.deliver()
        self.partner()

    def send_shares(self, altered: Callable[[ShareBundle], ShareBundle] = lambda bundle: bundle) -> None:
        """Stage 2's first half: rosters out, bundles in (each as `altered` makes it: a test's forger)."""
        for roster in self.on_server(self.server.rosters):
            device = roster.device_id
            bundle = self.on_device(device, self.devices[device].on_roster, self.delivered(device, roster))
            self.on_server(self.server.on_shares, self.sent(device, altered(bundle)))

    def deliver(self, altered: Callable[[DeliveryAck], DeliveryAck] = lambda ack: ack) -> None:
        """Stage 2's second half: the sealed shares routed to their recipients, each delivery acknowledged (as
        `altered` makes it: a test's false accuser)."""
        for delivery in self.on_server(self.server.deliveries):
            device = delivery.device_id
            ack = self.on_device(device, self.devices[device].on_delivery, self.delivered(device, delivery))
            self.on_server(self.server.on_ack, self.sent(device, altered(ack)))

    def partner(self, silent: Iterable[str] = ()) -> None:
        """Complaints settled by the accused senders' keys (the `silent` ones do not answer), then each device that
        is still in the round told its mask partners."""
        for complaint in self.on_server(self.server.key_requests):
            device = complaint.device_id
            if device in silent:
                continue
            reveal = self.on_device(device, self.devices[device].on_key_request, self.delivered(device, complaint))
            self.on_server(self.server.on_key_reveal, self.sent(device, reveal))
        for request in self.on_server(self.server.mask_requests):
            device = request.device_id
            self.on_device(device, self.devices[device].on_mask_request, self.delivered(device, request))

    def mask(self, senders: Iterable[str]) -> None:
        """Stage 3: these devices send their masked inputs."""
        for device in senders:
            masked = self.on_device(device, self.devices[device].masked_input, self.updates[device])
            self.on_server(self.server.on_masked, self.sent(device, masked))

    def unmask(self, answering: Iterable[str], confirming: Iterable[str] | None = None) -> SecAggResult:
        """Stage 4: the `confirming` devices (every survivor when None) confirm their views, then the `answering`
        ones answer their unmask requests; then the coordinator finishes."""
        self.confirm(confirming)
        return self.reveal(answering)

    def reveal(self, answering: Iterable[str]) -> SecAggResult:
        """Stage 4b: these devices answer their unmask requests; then the coordinator finishes."""
        wanted = set(answering)
        for request in self.on_server(self.server.unmask_requests):
            device = request.device_id
            if device in wanted:
                response = self.on_device(device, self.devices[device].on_unmask, self.delivered(device, request))
                self.on_server(self.server.on_reveal, self.sent(device, response))
        return self.on_server(self.server.finish)

    def confirm(self, confirming: Iterable[str] | None = None) -> None:
        """Stage 4a: these devices (every survivor when None) confirm the view they are sent."""
        views = self.on_server(self.server.view_requests)
        wanted = {view.device_id for view in views} if confirming is None else set(confirming)
        for view in views:
            device = view.device_id
            if device in wanted:
                confirmation = self.on_device(device, self.devices[device].on_view, self.delivered(device, view))
                self.on_server(self.server.on_confirm, self.sent(device, confirmation))

    def sent(self, device: str, message: Any) -> Any:
        """The message as the coordinator reads it, its bytes counted as the device's upload."""
        data = wire.encode(message)
        self.costs.sent[device] += len(data)
        return wire.decode(data, type(message))

    def delivered(self, device: str, message: Any) -> Any:
        """The message as the device reads it, its bytes counted as the device's download."""
        data = wire.encode(message)
        self.costs.received[device] += len(data)
        return wire.decode(data, type(message))

    def on_device(self, device: str, call: Callable[..., T], *args: Any) -> T:
        """A device's step, timed as its compute."""
        start = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.costs.device_seconds[device] += time.perf_counter() - start

    def on_server(self, call: Callable[..., T], *args: Any) -> T:
        """A coordinator's step, timed as its compute."""
        start = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.costs.server_seconds += time.perf_counter() - start


def plain_sum(updates: dict[str, Weights], devices: Iterable[str]) -> Weights:
    """The float64 sum of these devices' updates."""
    chosen = list(devices)
    return {
        name: np.asarray(np.sum([updates[d][name] for d in chosen], axis=0, dtype=np.float64))
        for name in updates[chosen[0]]
    }


def largest_error(total: Weights, expected: Weights) -> float:
    """The largest coordinate difference between two weight sets."""
    return max(float(np.abs(total[name] - expected[name]).max()) for name in expected)
