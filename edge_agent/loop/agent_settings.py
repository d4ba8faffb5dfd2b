# Who a device is, where its broker is and how hard it may work: the settings every part of the agent reads.
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from edge_agent.learning.compute import ComputeSettings
from protocol import wire
from protocol.credentials import DeviceIdentity
from protocol.errors import UsageError


@dataclass(frozen=True)
class AgentSettings:
    """Who the device is, where its broker is and how hard it may work."""

    fleet: str
    device_id: str
    profile: str = "simulated"
    inference_batch: int = ComputeSettings.inference_batch
    torch_threads: int = ComputeSettings.torch_threads
    exit_on_final: bool = False
    max_update_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES
    backend: str = ComputeSettings.backend
    trainer: str = ComputeSettings.trainer
    memory_budget_mb: int | None = None
    inference_threads: int = ComputeSettings.inference_threads
    execution_providers: tuple[str, ...] = ComputeSettings.execution_providers
    mc_passes_cap: int | None = None
    stream: bool = False
    signing_key: bytes = b""
    identity: DeviceIdentity = field(default_factory=DeviceIdentity)  # secure aggregation's signed key adverts
    slowdown: float = 1.0  # a bench knob: each round takes this many times its own compute time (see Agent)
    share_pool_statistics: bool = False  # the operator's consent to send the pool's posterior sums (privacy.md)

    def __post_init__(self) -> None:
        if not 1.0 <= self.slowdown <= 1000.0:
            raise UsageError(f"--slowdown must lie in [1, 1000], got {self.slowdown}")

    @property
    def compute(self) -> ComputeSettings:
        """How the device runs its models, as the learning room reads it."""
        return ComputeSettings(
            self.backend,
            self.trainer,
            self.inference_batch,
            self.inference_threads,
            self.execution_providers,
            self.torch_threads,
        )

    @property
    def scores_with_onnxruntime(self) -> bool:
        """True when the device scores its pool with the coordinator's ONNX bundle rather than with torch."""
        return self.compute.scores_with_onnxruntime


def device_seed(device_id: str) -> int:
    """A stable per-device number, so that devices with the same recipe seed still draw differently."""
    return int.from_bytes(hashlib.sha256(device_id.encode()).digest()[:4], "little")
