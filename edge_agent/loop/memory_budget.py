# The profile's memory budget: an agent fits its scoring batch to it, or refuses to start with a one-line reason.
from __future__ import annotations

import ctypes
import dataclasses
import logging
from dataclasses import dataclass

from edge_agent.loop.agent_settings import AgentSettings
from protocol.errors import UsageError
from protocol.model_spec import DEFAULT_SPEC, ModelSpec

log = logging.getLogger(__name__)

# Measured with benchmarks/agent_footprint.py (x86, 2 cores; see docs/field.md, "What a device can afford"): the peak RSS of a round less its
# pool and scoring batch. A full trainer imports torch (245 MB alone) and trains with autograd; a head trainer runs
# onnxruntime and numpy only.
RUNTIME_FLOOR_MB = {"full": 380.0, "head": 92.0}
MB_PER_BATCH_IMAGE = 0.33  # onnxruntime scoring: prefix activations and masks per image of the batch
MIN_INFERENCE_BATCH = 1  # a profile's own smaller batch is kept: the Pi Zero scores 4 camera images at a time
IMAGE_BYTES = 28 * 28  # what a pool image of the paper CNN adds (measured): the count for a model not measured
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's own starting value, held there


@dataclass(frozen=True)
class BackboneFootprint:
    """What a head trainer holds for a pretrained backbone beyond RUNTIME_FLOOR_MB (its ONNX session, the class
    statistics' second moment) and per pool image (its cached feature row, read for scoring in float32 and float64)."""

    extra_mb: float
    row_bytes: float


# Measured on the Pi Zero 2 W profile at 96 px (benchmarks/camera_bench.py --devices 1, pools of 500 and 4000 scenes,
# the pooled head: peaks 152 and 176 MB; docs/field.md, "What a device can afford").
BACKBONE_FOOTPRINTS = {"efficientnet-lite0": BackboneFootprint(extra_mb=58.0, row_bytes=1280 * 7.5)}


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


def footprint_of(trainer: str, spec: ModelSpec) -> BackboneFootprint:
    """What the spec's model adds to the trainer's floor and holds per pool image: a head trainer's measured
    backbone footprint, else what was measured for the paper CNN (nothing beyond the floor, IMAGE_BYTES an image; a
    folder pool decodes its images a batch at a time, so a larger image is not held per image)."""
    known = BACKBONE_FOOTPRINTS.get(spec.architecture) if trainer == "head" else None
    return known or BackboneFootprint(0.0, float(IMAGE_BYTES))


def estimated_peak_mb(trainer: str, pool_size: int, inference_batch: int, spec: ModelSpec = DEFAULT_SPEC) -> float:
    """The round's expected peak RSS: the trainer's runtime floor, the backbone's, the pool's rows and the scoring
    batch."""
    footprint = footprint_of(trainer, spec)
    pool_mb = pool_size * footprint.row_bytes / 2**20
    return RUNTIME_FLOOR_MB[trainer] + footprint.extra_mb + pool_mb + inference_batch * MB_PER_BATCH_IMAGE


def fit_to_budget(
    settings: AgentSettings, budget_mb: int, pool_size: int, spec: ModelSpec = DEFAULT_SPEC
) -> AgentSettings:
    """The settings with the scoring batch shrunk until the estimated peak (of the spec's model) fits `budget_mb`;
    MemoryBudgetError naming the numbers when not even MIN_INFERENCE_BATCH fits."""
    needed = estimated_peak_mb(settings.trainer, pool_size, MIN_INFERENCE_BATCH, spec)
    if needed > budget_mb:
        hint = " (a 'head' trainer needs no torch)" if settings.trainer == "full" else ""
        raise MemoryBudgetError(
            f"memory_budget_mb = {budget_mb} of profile {settings.profile!r} is below the ~{needed:.0f} MB a "
            f"{settings.trainer!r} trainer of {spec.architecture[:64]} needs with a pool of {pool_size} images{hint}"
        )
    batch = settings.inference_batch
    while batch > MIN_INFERENCE_BATCH and estimated_peak_mb(settings.trainer, pool_size, batch, spec) > budget_mb:
        batch //= 2
    if batch != settings.inference_batch:
        log.warning(
            "scoring batch cut to fit the memory budget budget_mb=%d batch=%d was=%d",
            budget_mb,
            batch,
            settings.inference_batch,
        )
    return dataclasses.replace(settings, inference_batch=batch)
