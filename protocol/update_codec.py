# Update encodings: weights as float32, or their delta from the round's base in fp16 or int8, dense or top-k.
"""An update travels as `float32` (the weights themselves), `fp16-delta` or `int8-delta` (the delta from the base
model the update names; int8 with one scale per tensor, or one per output channel: the first axis). With top-k a
tensor sends only its k largest-magnitude delta entries (values and ascending flat indices); what it leaves out,
quantisation error included, is the residual the device adds to its next delta (error feedback). Decoding checks
every part and raises CodecError with a RejectionKind and a reason of bounded length. Pure numpy: no torch.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from protocol.errors import RefusalError, UsageError
from protocol.files import UnreadableFileError, load_arrays, save_arrays
from protocol.messages import Recipe, RejectionKind, Update
from protocol.tensors import Weights, WeightSpec, spec_of
from protocol.wire import COMPRESSIONS, shown, shown_names

log = logging.getLogger(__name__)

FLOAT32 = "float32"
DELTA_DTYPES: dict[str, np.dtype] = {"fp16-delta": np.dtype(np.float16), "int8-delta": np.dtype(np.int8)}
ENCODINGS = (FLOAT32, *DELTA_DTYPES)
SCALES = ("tensor", "channel")
INT8_LEVELS = 127
RESIDUAL_FILE = "update_residual.npz"


class CodecError(RefusalError, ValueError):
    """An encoded update that cannot be decoded: the rejection kind it earns and why (names and values capped)."""

    def __init__(self, kind: RejectionKind, reason: str) -> None:
        self.kind = kind
        super().__init__(reason)


@dataclass(frozen=True)
class Encoded:
    """An update's tensors as they travel: the encoding, the values, int8's scales and top-k's flat indices."""

    encoding: str
    tensors: Weights
    scales: Weights = field(default_factory=dict)
    indices: Weights = field(default_factory=dict)

    @classmethod
    def of(cls, update: Update) -> Encoded:
        """The encoded parts of a received update."""
        return cls(update.encoding, update.tensors, update.scales, update.indices)


@dataclass(frozen=True)
class UpdateCodec:
    """What the recipe asks of a device's update: the encoding, int8's scale granularity, the fraction of each
    tensor's entries sent (top-k; 0 sends them all), and whether the message is deflated."""

    encoding: str = FLOAT32
    scales: str = "tensor"
    top_k: float = 0.0
    compression: str = "none"

    @classmethod
    def of(cls, recipe: Recipe) -> UpdateCodec:
        """The codec a recipe chooses, checked (UsageError saying what does not fit)."""
        return cls(
            recipe.update_encoding, recipe.update_scales, recipe.update_top_k, recipe.update_compression
        ).checked()

    def checked(self) -> UpdateCodec:
        """Itself, or UsageError when the encoding or scales are unknown or do not go together."""
        if self.encoding not in ENCODINGS:
            raise UsageError(f"unknown update encoding {shown(self.encoding)}; known: {', '.join(ENCODINGS)}")
        if self.scales not in SCALES:
            raise UsageError(f"update scales must be one of {', '.join(SCALES)}, got {shown(self.scales)}")
        if self.scales == "channel" and self.encoding != "int8-delta":
            raise UsageError("per-channel scales need the int8-delta encoding")
        if not 0.0 <= self.top_k < 1.0:
            raise UsageError(f"update top-k must lie in [0, 1), got {shown(self.top_k)}")
        if self.top_k > 0 and self.encoding == FLOAT32:
            raise UsageError("top-k sends a sparse delta: it needs fp16-delta or int8-delta")
        if self.compression not in COMPRESSIONS:
            raise UsageError(
                f"update compression must be one of {', '.join(COMPRESSIONS)}, got {shown(self.compression)}"
            )
        return self

    def encode(self, weights: Weights, base: Weights, residual: Weights | None = None) -> tuple[Encoded, Weights]:
        """(the encoded update, the new residual): float32 sends the weights; a delta encoding sends
        weights - base plus the residual of earlier rounds, and the new residual is what it leaves out."""
        if self.encoding == FLOAT32:
            return Encoded(FLOAT32, dict(weights)), {}
        target = {name: weights[name].astype(np.float64) - base[name] for name in base}
        if residual:
            target = {name: delta + residual[name] for name, delta in target.items()}
        encoded = Encoded(self.encoding, {}, {}, {})
        for name, delta in target.items():
            self.encode_tensor(encoded, name, delta)
        sent = decode_delta(encoded, spec_of(base))
        return encoded, {name: (target[name] - sent[name]).astype(np.float32) for name in target}

    def encode_tensor(self, encoded: Encoded, name: str, delta: np.ndarray) -> None:
        """Adds one tensor's delta to `encoded`: all of it, or its k largest magnitudes and their flat indices."""
        flat, positions = delta.reshape(-1), None
        if self.top_k > 0:
            positions = top_k_indices(flat, max(1, math.ceil(self.top_k * flat.size)))
            encoded.indices[name] = positions.astype(np.uint16 if flat.size <= 1 << 16 else np.uint32)
        values = flat if positions is None else flat[positions]
        if self.encoding == "int8-delta":
            channels = delta.shape[0] if self.scales == "channel" and delta.ndim >= 2 else 0
            rows = channel_rows(delta.shape, channels, positions)
            peak = np.zeros(max(channels, 1))
            np.maximum.at(peak, rows, np.abs(values))
            scale = np.where(peak > 0, peak / INT8_LEVELS, 1.0).astype(np.float32)
            encoded.scales[name] = scale if channels else scale.reshape(())
            values = np.clip(np.rint(values / scale[rows]), -INT8_LEVELS, INT8_LEVELS)
        sent = values.astype(DELTA_DTYPES[self.encoding])
        encoded.tensors[name] = sent if positions is not None else sent.reshape(delta.shape)


def top_k_indices(flat: np.ndarray, k: int) -> np.ndarray:
    """The flat indices of the k largest magnitudes, ascending."""
    return np.sort(np.argpartition(-np.abs(flat), k - 1)[:k])


def channel_rows(shape: tuple[int, ...], channels: int, positions: np.ndarray | None) -> np.ndarray:
    """The scale each entry uses: its index along the first axis with per-channel scales (channels > 0), else 0;
    for the entries at `positions` (flat indices), or for every entry when it is None."""
    size = math.prod(shape)
    flat = np.arange(size) if positions is None else positions.astype(np.int64)
    return flat // (size // channels) if channels else np.zeros(len(flat), dtype=np.int64)


def decode_update(encoded: Encoded, base: Weights) -> Weights:
    """The weights an update stands for: float32 as sent (the decoded arrays themselves, no copy); a delta added to
    the base in place of its float64 values (the layout and finiteness of the result are the caller's to check).
    CodecError on any malformed part."""
    if encoded.encoding == FLOAT32:
        if encoded.scales or encoded.indices:
            raise CodecError(RejectionKind.BAD_ENCODING, "a float32 update carries neither scales nor indices")
        return encoded.tensors
    delta = decode_delta(encoded, spec_of(base))
    with np.errstate(over="ignore", invalid="ignore"):
        return {name: np.add(base[name], delta[name], out=delta[name]).astype(base[name].dtype) for name in base}


def decode_delta(encoded: Encoded, spec: WeightSpec) -> Weights:
    """The float64 delta of every tensor of the layout; CodecError on any malformed part."""
    check_parts(encoded, spec)
    return {name: decoded_tensor(encoded, name, shape) for name, (shape, _) in spec.items()}


def check_parts(encoded: Encoded, spec: WeightSpec) -> None:
    """CodecError unless the encoding is a known delta, the names are the model's, and scales and indices name
    only those tensors (int8: every one of them has a scale)."""
    if encoded.encoding not in DELTA_DTYPES:
        raise CodecError(
            RejectionKind.BAD_ENCODING, f"unknown update encoding {shown(encoded.encoding)}; known: {ENCODINGS}"
        )
    missing, extra = sorted(set(spec) - set(encoded.tensors)), sorted(set(encoded.tensors) - set(spec))
    if missing or extra:
        reason = (
            f"tensor names differ from the base model: missing {shown_names(missing)}, unexpected {shown_names(extra)}"
        )
        raise CodecError(RejectionKind.TENSOR_MISMATCH, reason)
    stray = sorted(set(encoded.indices) - set(spec))
    if stray:
        raise CodecError(RejectionKind.BAD_ENCODING, f"indices for tensors the model lacks: {shown_names(stray)}")
    scaled = set(spec) if encoded.encoding == "int8-delta" else set()
    if set(encoded.scales) != scaled:
        unscaled, unexpected = sorted(scaled - set(encoded.scales)), sorted(set(encoded.scales) - scaled)
        reason = f"{encoded.encoding} scales: missing {shown_names(unscaled)}, unexpected {shown_names(unexpected)}"
        raise CodecError(RejectionKind.BAD_ENCODING, reason)


def decoded_tensor(encoded: Encoded, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """One tensor's float64 delta: the values (dense, or scattered to their indices), times int8's scales."""
    values, dtype = encoded.tensors[name], DELTA_DTYPES[encoded.encoding]
    if values.dtype != dtype:
        raise CodecError(RejectionKind.TENSOR_MISMATCH, f"tensor {shown(name)} is {values.dtype}, not {dtype}")
    size = math.prod(shape)
    positions = checked_indices(name, encoded.indices[name], size) if name in encoded.indices else None
    expected = shape if positions is None else (len(positions),)
    if values.shape != expected:
        reason = f"tensor {shown(name)} has shape {values.shape}, expected {expected}"
        raise CodecError(RejectionKind.TENSOR_MISMATCH, reason)
    flat = values.reshape(-1).astype(np.float64)
    if name in encoded.scales:
        np.multiply(flat, scale_of_entries(name, encoded.scales[name], shape, positions), out=flat)
    if positions is None:
        return flat.reshape(shape)
    delta = np.zeros(size)
    delta[positions] = flat
    return delta.reshape(shape)


def checked_indices(name: str, indices: np.ndarray, size: int) -> np.ndarray:
    """A sparse tensor's flat indices as int64: integers, one axis, at most the tensor's size, in range, strictly
    ascending (so none is sent twice); CodecError saying which rule they break."""
    where = f"indices of tensor {shown(name)}"
    if indices.dtype.kind not in "iu" or indices.ndim != 1:
        raise CodecError(RejectionKind.BAD_ENCODING, f"{where} must be one axis of integers, got {indices.dtype}")
    if len(indices) > size:
        raise CodecError(RejectionKind.OUT_OF_RANGE, f"{where}: k={len(indices)} exceeds the tensor's {size} entries")
    if len(indices) and (indices.min() < 0 or indices.max() >= size):
        low, high = int(indices.min()), int(indices.max())
        raise CodecError(RejectionKind.OUT_OF_RANGE, f"{where} span [{low}, {high}], outside [0, {size})")
    steps = np.diff(indices.astype(np.int64))
    if np.any(steps == 0):
        raise CodecError(RejectionKind.BAD_ENCODING, f"{where} repeat an entry")
    if np.any(steps < 0):
        raise CodecError(RejectionKind.BAD_ENCODING, f"{where} are not in ascending order")
    return indices.astype(np.int64)


def scale_of_entries(name: str, scale: np.ndarray, shape: tuple[int, ...], positions: np.ndarray | None) -> np.ndarray:
    """The int8 scale of each sent entry: one per tensor (shape ()) or per first-axis channel; CodecError unless
    it is float32, finite and positive."""
    where = f"scale of tensor {shown(name)}"
    channel_shapes = [()] + ([(shape[0],)] if shape else [])
    if scale.dtype != np.float32 or scale.shape not in channel_shapes:
        reason = f"{where} is {scale.dtype} of shape {scale.shape}; expected float32 of shape {' or '.join(map(str, channel_shapes))}"
        raise CodecError(RejectionKind.TENSOR_MISMATCH, reason)
    flat = scale.reshape(-1)
    if not np.all(np.isfinite(flat)):
        raise CodecError(RejectionKind.NON_FINITE, f"{where} is not finite ({flat[~np.isfinite(flat)][0]})")
    if np.any(flat <= 0):
        raise CodecError(RejectionKind.OUT_OF_RANGE, f"{where} must be positive, got {flat[flat <= 0][0]}")
    channels = flat.size if scale.ndim else 0
    return flat[channel_rows(shape, channels, positions)].astype(np.float64)


class ResidualStore:
    """Error feedback's residual on the device's disk (written atomically), so a restart keeps what is owed."""

    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / RESIDUAL_FILE

    def load(self, base: Weights) -> Weights | None:
        """The kept residual if it has the base model's layout, else None (a new model starts afresh)."""
        if not self.path.is_file():
            return None
        try:
            residual = load_arrays(self.path)
        except UnreadableFileError as error:
            log.warning("residual unreadable, starting afresh error=%s", error)
            return None
        return residual if spec_of(residual) == spec_of(base) else None

    def save(self, residual: Weights) -> None:
        """Keeps the residual for the next round."""
        save_arrays(self.path, residual)


def encode_update(weights: Weights, base: Weights, codec: UpdateCodec, residuals: ResidualStore) -> Encoded:
    """A device's update as its recipe's codec encodes it; with top-k, the residual kept on disk is added to the
    delta and what this update leaves out is kept for the next one."""
    if codec.top_k == 0:
        return codec.encode(weights, base)[0]
    encoded, residual = codec.encode(weights, base, residuals.load(base))
    residuals.save(residual)
    return encoded
