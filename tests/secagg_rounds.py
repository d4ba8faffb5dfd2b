# Drives in-process secure rounds for the tests: devices and coordinator exchange every message through the wire.
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from coordinator.secagg_round import SecAggSettings
from coordinator.secagg_server import SecAggServer
from coordinator.secagg_unmask import SecAggResult
from edge_agent.loop.secagg_device import SecAggDevice
from protocol import wire
from protocol.tensors import Weights

ROUND = 7


def via(message: Any) -> Any:
    """The message as the other side reads it: encoded, then decoded and checked."""
    return wire.decode(wire.encode(message), type(message))


def head_updates(count: int, seed: int = 0, scale: float = 0.5) -> dict[str, Weights]:
    """Head-sized updates (a 10-class head on 64 features) with values within the clip."""
    generator = np.random.default_rng(seed)
    return {
        f"dev{i:03d}": {
            "classifier.weight": generator.uniform(-scale, scale, (10, 64)).astype(np.float32),
            "classifier.bias": generator.uniform(-scale, scale, 10).astype(np.float32),
        }
        for i in range(count)
    }


@dataclass
class SecureRound:
    """A coordinator and its devices in one secure round, with the updates each device will mask."""

    server: SecAggServer
    devices: dict[str, SecAggDevice]
    updates: dict[str, Weights]

    @classmethod
    def started(cls, updates: dict[str, Weights], **settings: Any) -> SecureRound:
        """Stage 1 done: every device advertised its keys."""
        ids = sorted(updates)
        layout = updates[ids[0]]
        server = SecAggServer.start("run-a", ROUND, ids, layout, SecAggSettings(graph_seed=b"public", **settings))
        devices = {device: SecAggDevice.start(device, ROUND) for device in ids}
        for device in devices.values():
            server.on_keys(via(device.advert()))
        return cls(server, devices, updates)

    def share(self) -> None:
        """Stage 2 done: rosters out, bundles in, deliveries out."""
        for roster in self.server.rosters():
            self.server.on_shares(via(self.devices[roster.device_id].on_roster(via(roster))))
        for delivery in self.server.deliveries():
            self.devices[delivery.device_id].on_delivery(via(delivery))

    def mask(self, senders: Iterable[str]) -> None:
        """Stage 3: these devices send their masked inputs."""
        for device in senders:
            self.server.on_masked(via(self.devices[device].masked_input(self.updates[device])))

    def unmask(self, answering: Iterable[str]) -> SecAggResult:
        """Stage 4: these devices answer their unmask requests; then the coordinator finishes."""
        wanted = set(answering)
        for request in self.server.unmask_requests():
            if request.device_id in wanted:
                self.server.on_reveal(via(self.devices[request.device_id].on_unmask(via(request))))
        return self.server.finish()


def plain_sum(updates: dict[str, Weights], devices: Iterable[str]) -> Weights:
    """The float64 sum of these devices' updates."""
    chosen = list(devices)
    return {name: sum(updates[d][name].astype(np.float64) for d in chosen) for name in updates[chosen[0]]}


def largest_error(total: Weights, expected: Weights) -> float:
    """The largest coordinate difference between two weight sets."""
    return max(float(np.abs(total[name] - expected[name]).max()) for name in expected)
