# The profile's memory budget: an agent fits its scoring batch to it, or refuses to start with a one-line reason.
from __future__ import annotations

import ctypes
import dataclasses
import logging

from edge_agent.loop.agent_settings import AgentSettings
from protocol.errors import UsageError

log = logging.getLogger(__name__)

# Measured with benchmarks/agent_footprint.py (x86, 2 cores; see docs/field.md, "What a device can afford"): the peak RSS of a round less its
# pool and scoring batch. A full trainer imports torch (245 MB alone) and trains with autograd; a head trainer runs
# onnxruntime and numpy only.
RUNTIME_FLOOR_MB = {"full": 380.0, "head": 92.0}
MB_PER_BATCH_IMAGE = 0.33  # onnxruntime scoring: prefix activations and masks per image of the batch
MIN_INFERENCE_BATCH = 1  # a profile's own smaller batch is kept: the Pi Zero scores 4 camera images at a time
IMAGE_BYTES = 28 * 28
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's own starting value, held there


def keep_large_frees_returnable() -> bool:
    """Holds glibc's mmap threshold at 128 KiB, so every block of that size or more (each numpy array a round makes
    of a pool) is a mapping of its own, given back to the system when freed. Left to itself glibc raises the
    threshold after each large free (up to 32 MiB), and a round's arrays then come from the heap and stay in the
    agent's resident set: on the Pi Zero 2 W profile at its 4000-image pool cap, peaks of 211 MB scoring and 192-227 MB
    training against 162 and 140-199 MB held (docs/benchmarks/semi_supervised). False where the C library has no
    mallopt (not glibc: nothing is changed)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no C library to load, or one without mallopt (macOS, musl's stub aside)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


class MemoryBudgetError(UsageError):
    """The profile's memory budget cannot hold this agent's work, even with the smallest scoring batch."""


def estimated_peak_mb(trainer: str, pool_size: int, inference_batch: int) -> float:
    """The round's expected peak RSS: the trainer's runtime floor, the pool's images, the scoring batch."""
    return RUNTIME_FLOOR_MB[trainer] + pool_size * IMAGE_BYTES / 2**20 + inference_batch * MB_PER_BATCH_IMAGE


def fit_to_budget(settings: AgentSettings, budget_mb: int, pool_size: int) -> AgentSettings:
    """The settings with the scoring batch shrunk until the estimated peak fits `budget_mb`; MemoryBudgetError
    naming the numbers when not even MIN_INFERENCE_BATCH fits."""
    needed = estimated_peak_mb(settings.trainer, pool_size, MIN_INFERENCE_BATCH)
    if needed > budget_mb:
        hint = " (a 'head' trainer needs no torch)" if settings.trainer == "full" else ""
        raise MemoryBudgetError(
            f"memory_budget_mb = {budget_mb} of profile {settings.profile!r} is below the ~{needed:.0f} MB a "
            f"{settings.trainer!r} trainer needs with a pool of {pool_size} images{hint}"
        )
    batch = settings.inference_batch
    while batch > MIN_INFERENCE_BATCH and estimated_peak_mb(settings.trainer, pool_size, batch) > budget_mb:
        batch //= 2
    if batch != settings.inference_batch:
        log.warning(
            "scoring batch cut to fit the memory budget budget_mb=%d batch=%d was=%d",
            budget_mb,
            batch,
            settings.inference_batch,
        )
    return dataclasses.replace(settings, inference_batch=batch)
