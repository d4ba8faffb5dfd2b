# The wire's messages as typed values: the round recipe, announcement, model, bundle, frozen backbone, encoder, update,
# ack, status, chunk, secure aggregation's stages, and the rejection kinds an ack names; `wire` encodes and decodes them.
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar, Protocol, TypeVar

import numpy as np

from protocol.bounds import INT_RANGE, TIME_RANGE, within
from protocol.label_messages import (
    AnswerReceipt,
    CorrectionReceipt,
    LabelAnswer,
    LabelCorrection,
    LabelQuery,
    LocalAnswer,
    QueryReceipt,
)
from protocol.model_spec import ModelSpec
from protocol.prediction_messages import PredictionBatch
from protocol.recipe_flags import OMITTED_KEY, recipe_field
from protocol.secagg_messages import (
    DeliveryAck,
    KeyAdvert,
    KeyRoster,
    MaskedInput,
    MaskRequest,
    RecordKeyRequest,
    RecordKeyReveal,
    ShareBundle,
    ShareDelivery,
    SurvivorView,
    UnmaskRequest,
    UnmaskResponse,
    ViewConfirmation,
)
from protocol.serving_messages import ServingMessage

Tensors = dict[str, np.ndarray]

METRIC_MEME_ENTROPY = "meme_entropy"

# A field with this metadata is left out of the message while it holds its default, so a message that does not use
# it (a float32 update, a recipe without compression) has the same bytes as before the field existed.
OMITTED_AT_DEFAULT = {OMITTED_KEY: True}


class RejectionKind(StrEnum):
    """Why an update was refused, as a stable label for acks, the store and metrics (the reason text says more)."""

    TOO_LARGE = "too_large"
    UNDECODABLE = "undecodable"
    DEVICE_MISMATCH = "device_mismatch"
    STALE_ROUND = "stale_round"
    STALE = "stale"  # asynchronous rounds: trained from a version older than the allowed staleness
    FUTURE_ROUND = "future_round"
    BASE_MISMATCH = "base_mismatch"
    TENSOR_MISMATCH = "tensor_mismatch"
    NON_FINITE = "non_finite"
    OUT_OF_RANGE = "out_of_range"
    BAD_COUNTS = "bad_counts"
    NOT_RELAY = "not_relay"  # an update naming contributors from a device the coordinator was not told is a relay
    MISSING_METRIC = "missing_metric"
    BAD_METRIC = "bad_metric"
    DUPLICATE = "duplicate"
    NOT_SELECTED = "not_selected"
    NO_ROUND = "no_round"
    UNKNOWN_DEVICE = "unknown_device"
    BAD_SIGNATURE = "bad_signature"
    REPLAY = "replay"
    BAD_ENCODING = "bad_encoding"
    BAD_CHUNK = "bad_chunk"
    TRANSFER_LIMIT = "transfer_limit"
    FORGED_SHARE = "forged_share"  # secure aggregation: a share that does not open, fit its point or rebuild its secret
    WRONG_RECIPIENT = "wrong_recipient"  # secure aggregation: a share addressed to a device that must not hold it
    UNSAFE_REQUEST = "unsafe_request"  # secure aggregation: an unmask request an honest device refuses
    WRONG_STAGE = "wrong_stage"  # secure aggregation: a message for a stage the round is not in
    SET_ASIDE = "set_aside"  # a message whose handling failed three times (a bug: the log has its traceback)


@dataclass(frozen=True)
class Recipe:
    """What a device does in one round: how to acquire labels and how to train on them. Each field with a flag
    declares it here, once: the command line, its checks, the docs' recipe table and the wire follow from it."""

    sampler: str = recipe_field("margin", "how a device picks the samples it asks labels for", choices="sampler")
    labels_per_acquisition: int = recipe_field(400, "labels a device asks for in each acquisition", low=0)
    acquisitions_per_round: int = recipe_field(1, "acquisitions in each active round", low=1)
    local_rule: str = recipe_field("kept-labels", "how a device trains on its labels", choices="local rule")
    epochs: int = recipe_field(5, "local training epochs per round", low=1)
    batch_size: int = recipe_field(32, "local training batch size", low=1)
    learning_rate: float = recipe_field(0.01, "local SGD learning rate", flag="--lr", low=0.0)
    momentum: float = recipe_field(0.9, "local SGD momentum", low=0.0, high=1.0, high_open=True)
    weight_decay: float = recipe_field(5e-4, "local SGD weight decay", low=0.0)
    mc_passes: int = recipe_field(10, "MC-dropout passes when a device scores its pool", low=1)
    seed: int = recipe_field(0, "seed of the run: W0, sampling, shards and local training", low=0)
    options: dict[str, float] = field(default_factory=dict)
    rounds_per_acquisition: int = recipe_field(
        1, "communication rounds per active round; devices acquire in its first", low=1
    )
    initial_label_fraction: float = recipe_field(
        0.0,
        "a device labels this random fraction of its own data before its first round, which trains on them "
        "without acquiring",
        low=0.0,
        high=1.0,
    )
    label_fraction: float = recipe_field(
        0.0,
        "labels per acquisition = ceil(F * own samples), overriding --labels-per-acquisition (0: off)",
        low=0.0,
        high=1.0,
    )
    encoder: str = ""
    update_encoding: str = recipe_field(
        "float32",
        "what devices send: the weights, or their delta from the round's model in fp16 or int8",
        omitted_at_default=True,
        choices="update encoding",
    )
    update_scales: str = recipe_field(
        "tensor",
        "int8-delta's scales: one per tensor, or per output channel",
        omitted_at_default=True,
        choices="update scales",
    )
    update_top_k: float = recipe_field(
        0.0,
        "send only this fraction of each tensor's delta (largest first; the device keeps the rest for later rounds)",
        omitted_at_default=True,
        low=0.0,
        high=1.0,
        high_open=True,
    )
    update_compression: str = recipe_field(
        "none",
        "deflate each update message (lossless; fp16 and int8 deltas shrink by a third to a half again)",
        omitted_at_default=True,
        choices="update compression",
    )
    lr_schedule: str = recipe_field(
        "constant",
        "the learning rate within a round's local training: constant, or cosine from --lr down towards 0 "
        "(restarting each round from the received global model)",
        omitted_at_default=True,
        choices="lr schedule",
    )
    dp: str = recipe_field(
        "off",
        "differential privacy (DP-FedAvg): the coordinator clips each delta and noises the sum (central), or each "
        "device clips its own delta and adds its share of the noise (device)",
        omitted_at_default=True,
        choices="dp placement",
    )
    dp_clip: float = recipe_field(
        0.1,
        "DP: the L2 norm a device's delta is clipped to (the first round's, when --dp-clip-quantile adapts it)",
        omitted_at_default=True,
        low=0.0,
    )
    dp_noise_multiplier: float = recipe_field(
        1.0,
        "DP: the noise multiplier z; the sum of clipped deltas gets Gaussian noise of std z * clip",
        omitted_at_default=True,
        low=0.0,
    )
    dp_clip_quantile: float = recipe_field(
        0.0,
        "DP: adapt the clip each round towards this quantile of the delta norms (Andrew et al. 2021; 0: fixed clip)",
        omitted_at_default=True,
        low=0.0,
        high=1.0,
        high_open=True,
    )
    dp_clip_lr: float = recipe_field(
        0.2,
        "DP: the adaptive clip's geometric learning rate eta",
        omitted_at_default=True,
        low=0.0,
    )
    secure_aggregation: str = recipe_field(
        "off",
        "secagg: devices mask their updates (SecAgg+) so the coordinator learns only the survivors' weighted sum",
        omitted_at_default=True,
        choices="secure aggregation",
    )
    secagg_dropout: float = recipe_field(
        0.1,
        "secure aggregation: the fraction of a round's devices the neighbour graph is sized to lose",
        omitted_at_default=True,
        low=0.0,
        high=0.5,
        high_open=True,
    )
    secagg_clip: float = recipe_field(
        1.0,
        "secure aggregation: each coordinate of a device's weighted delta is clipped to +-this before fixed point",
        omitted_at_default=True,
        low=1e-6,
    )
    secagg_sample_cap: int = recipe_field(
        1000,
        "secure aggregation: a device weighs min(samples, cap) / cap (0: every device weighs the same)",
        omitted_at_default=True,
        low=0,
    )
    drift_acquisitions: int = recipe_field(
        0,
        "after a device's newly arrived images drift from its older ones (their uncertain share jumped, or their "
        "predicted class mix moved), this many acquisitions ask only about images that arrived since (0: off)",
        omitted_at_default=True,
        low=0,
    )


@dataclass(frozen=True)
class RoundAnnouncement:
    """Published retained on the round topic: the current round, its base model and recipe, and the fleet's human
    labels per class as shares (empty: unknown), which a device weighs its own labels against to adapt the head it
    serves to its class mix (edge_agent.learning.prior_shift)."""

    KIND: ClassVar[str] = "round"
    run_id: str
    round_id: int
    model_hash: str
    recipe: Recipe
    deadline: float
    final: bool = False
    participants: list[str] = field(default_factory=list)
    spec_hash: str = ""
    label_shares: list[float] = field(default_factory=list, metadata=OMITTED_AT_DEFAULT)


@dataclass(frozen=True)
class ModelMessage:
    """Published retained on the model topic named by its hash: the global weights themselves. With a frozen
    backbone (`backbone`: the sha256 of the fp32 prefix graph, a `BackboneMessage`), the tensors that graph holds as
    initializers are left out; a device completes the model from its stored copy and checks the whole hash."""

    KIND: ClassVar[str] = "model"
    model_hash: str
    spec: ModelSpec
    tensors: Tensors
    backbone: str = field(default="", metadata=OMITTED_AT_DEFAULT)


BundleFiles = dict[str, bytes]
MAX_BUNDLE_FILES = 16


@dataclass(frozen=True)
class BundleMessage:
    """Published retained on the bundle topic of a model hash: that model's ONNX bundle, file by file.

    Devices that score with onnxruntime store the files, verify them against the manifest and run the graphs.
    The files named in `backbone` (a frozen prefix's graphs) are left out: each travels once per run as a
    `BackboneMessage` addressed by the sha256 the manifest lists for it.
    """

    KIND: ClassVar[str] = "bundle"
    model_hash: str
    files: BundleFiles
    backbone: list[str] = field(default_factory=list, metadata=OMITTED_AT_DEFAULT)


@dataclass(frozen=True)
class BackboneMessage:
    """Published retained on the backbone topic named by its sha256: one graph of a frozen prefix (fp32 or int8
    ONNX bytes), which every round's model and bundle of the run reference instead of carrying it."""

    KIND: ClassVar[str] = "backbone"
    backbone_hash: str
    data: bytes


@dataclass(frozen=True)
class EncoderMessage:
    """Published retained on the encoder topic named by its sha256: a frozen feature encoder as ONNX bytes."""

    KIND: ClassVar[str] = "encoder"
    encoder_hash: str
    onnx: bytes


@dataclass(frozen=True)
class Update:
    """A device's result for one round: its weights (or their delta from the base model, see
    protocol.update_codec: `encoding`, int8 `scales`, top-k flat `indices`) plus the counts and metrics
    strategies need. A relay's update also names the site devices it sums (`contributors`) and each one's sample
    count (`contributor_samples`), which must add up to `num_samples`."""

    KIND: ClassVar[str] = "update"
    device_id: str
    round_id: int
    update_id: str
    base_hash: str
    num_samples: int
    class_counts: list[int]
    acquired_labels: int
    metrics: dict[str, float]
    tensors: Tensors
    nonce: bytes = b""
    signature: bytes = b""
    encoding: str = field(default="float32", metadata=OMITTED_AT_DEFAULT)
    scales: Tensors = field(default_factory=dict, metadata=OMITTED_AT_DEFAULT)
    indices: Tensors = field(default_factory=dict, metadata=OMITTED_AT_DEFAULT)
    contributors: list[str] = field(default_factory=list, metadata=OMITTED_AT_DEFAULT)
    contributor_samples: list[int] = field(default_factory=list, metadata=OMITTED_AT_DEFAULT)


@dataclass(frozen=True)
class Ack:
    """The coordinator's answer to one update: accepted, or rejected with the reason and the rejection's kind (a
    RejectionKind value; "" when accepted)."""

    KIND: ClassVar[str] = "ack"
    device_id: str
    round_id: int
    update_id: str
    accepted: bool
    reason: str = ""
    rejection: str = ""


# A device's state while a round waits for people's answers to its queries (not training yet).
WAITING_FOR_ANSWERS = "waiting for answers"


@dataclass(frozen=True)
class Status:
    """A device's retained presence and progress; the broker publishes the 'offline' one as its last will.
    `part_restarts` and `set_aside` are its supervised parts' health (how often they restarted, how many messages
    they set aside), left out while both are 0."""

    KIND: ClassVar[str] = "status"
    device_id: str
    state: str
    timestamp: float = field(metadata=within(*TIME_RANGE))
    round_id: int = field(default=0, metadata=within(0, INT_RANGE[1]))
    labelled: int = field(default=0, metadata=within(0, INT_RANGE[1]))
    profile: str = ""
    peak_rss_mb: float = field(default=0.0, metadata=within(0.0, 1e9))
    part_restarts: int = field(default=0, metadata={**OMITTED_AT_DEFAULT, **within(0, INT_RANGE[1])})
    set_aside: int = field(default=0, metadata={**OMITTED_AT_DEFAULT, **within(0, INT_RANGE[1])})


@dataclass(frozen=True)
class Chunk:
    """One numbered piece of a message too large for the broker, published on `<topic>/chunk/<index>` (see
    protocol.chunks): every chunk of a transfer repeats the count, the whole payload's size and its sha256 (hex);
    chunk i holds bytes [i * s, (i + 1) * s) of the payload, with s = ceil(total_bytes / count)."""

    KIND: ClassVar[str] = "chunk"
    transfer_id: str
    index: int
    count: int
    total_bytes: int
    digest: str
    data: bytes


SecAggMessage = (
    KeyAdvert
    | KeyRoster
    | ShareBundle
    | ShareDelivery
    | DeliveryAck
    | RecordKeyRequest
    | RecordKeyReveal
    | MaskRequest
    | MaskedInput
    | SurvivorView
    | ViewConfirmation
    | UnmaskRequest
    | UnmaskResponse
)
SECAGG_TYPES = (
    KeyAdvert,
    KeyRoster,
    ShareBundle,
    ShareDelivery,
    DeliveryAck,
    RecordKeyRequest,
    RecordKeyReveal,
    MaskRequest,
    MaskedInput,
    SurvivorView,
    ViewConfirmation,
    UnmaskRequest,
    UnmaskResponse,
)


class Message(Protocol):
    """Any message the wire carries: a frozen dataclass whose KIND names it in the envelope."""

    KIND: ClassVar[str]


WIRE_TYPES: tuple[type[Message], ...] = (
    RoundAnnouncement,
    ModelMessage,
    BundleMessage,
    BackboneMessage,
    EncoderMessage,
    Update,
    Ack,
    Status,
    Chunk,
    ServingMessage,
    PredictionBatch,
    LabelQuery,
    QueryReceipt,
    LabelAnswer,
    AnswerReceipt,
    LocalAnswer,
    LabelCorrection,
    CorrectionReceipt,
    *SECAGG_TYPES,
)
MESSAGE_TYPES: dict[str, type[Message]] = {cls.KIND: cls for cls in WIRE_TYPES}
M = TypeVar("M", bound=Message)
