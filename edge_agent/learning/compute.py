# How a device runs its models: the scoring back end, what it trains, batch sizes, threads and ORT's providers.
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ComputeSettings:
    """What the learning room reads of a device's settings (the loop's AgentSettings gives it as `compute`): the
    back end that scores (torch or onnxruntime), the trainer (full model or classifier only), the inference batch,
    onnxruntime's threads (0: its default) and execution providers, and torch's threads."""

    backend: str = "torch"
    trainer: str = "full"
    inference_batch: int = 256
    inference_threads: int = 0
    execution_providers: tuple[str, ...] = ("CPUExecutionProvider",)
    torch_threads: int = 1

    @property
    def scores_with_onnxruntime(self) -> bool:
        """True when the device scores its pool with the coordinator's ONNX bundle rather than with torch."""
        return self.backend == "onnxruntime"
