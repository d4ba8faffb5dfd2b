# Tests for protocol.update_codec: round trips and their error bounds, top-k with error feedback, every rejection.
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
from coordinators import local_coordinator

from bench.simulate import BenchSettings, simulate
from coordinator.fleet.broker import EmbeddedBroker
from coordinator.intake.scratch import TensorScratch
from coordinator.intake.update_intake import RoundCollector
from coordinator.intake.validation import MAX_REASON_CHARS, Expectation, Rejection, decoded, validate_update
from coordinator.rounds.evaluation import Evaluator, LabelledSplit
from coordinator.rounds.rules import RoundPolicy
from coordinator.setup.settings import InitSettings, ServerSettings
from coordinator.storage.store import RunStore
from coordinator.strategies.registry import make_strategy
from edge_agent.learning.models import build_model, get_weights
from protocol import messages, wire
from protocol.messages import RejectionKind
from protocol.model_spec import DEFAULT_SPEC
from protocol.mqtt import MqttSession
from protocol.tensors import spec_of, weights_hash
from protocol.update_codec import (
    RESIDUAL_FILE,
    Encoded,
    ResidualStore,
    UpdateCodec,
    decode_delta,
    decode_update,
    encode_update,
)

FLOAT32_EPS = float(np.finfo(np.float32).eps)


def base_weights() -> dict[str, np.ndarray]:
    """A tiny model: a 4-channel conv weight whose channels differ in scale, a bias, a scalar."""
    return {
        "conv.weight": np.arange(48, dtype=np.float32).reshape(4, 3, 2, 2) / 10 - 2,
        "fc.bias": np.array([0.5, -1.0, 2.0, 0.0, 1.5], dtype=np.float32),
        "temperature": np.array(1.0, dtype=np.float32),
    }


def trained(base: dict[str, np.ndarray], seed: int = 0) -> dict[str, np.ndarray]:
    """The base moved as a device moves it; conv channel c moves about 10^-c, so per-channel scales matter."""
    rng = np.random.default_rng(seed)
    moved = {}
    for name, array in base.items():
        step = rng.normal(0, 0.05, array.shape)
        if name == "conv.weight":
            step *= 10.0 ** -np.arange(4).reshape(4, 1, 1, 1)
        moved[name] = np.asarray(array + step, dtype=np.float32)
    return moved


BASE = base_weights()
WEIGHTS = trained(BASE)


def offer(collector: RoundCollector, device_id: str, payload: bytes) -> tuple[messages.Update, bool]:
    """The collector's verdict on a payload, decoded once as the intake decodes it."""
    return collector.offer(decoded(device_id, payload, collector.expectation))


def test_float32_sends_the_weights_unchanged() -> None:
    encoded, residual = UpdateCodec().encode(WEIGHTS, BASE)
    assert encoded.encoding == "float32" and not encoded.scales and not encoded.indices and residual == {}
    assert all(np.array_equal(decode_update(encoded, BASE)[name], WEIGHTS[name]) for name in WEIGHTS)


def test_fp16_delta_is_within_half_an_fp16_step_of_the_delta() -> None:
    encoded, _ = UpdateCodec("fp16-delta").encode(WEIGHTS, BASE)
    assert all(values.dtype == np.float16 for values in encoded.tensors.values())
    decoded = decode_update(encoded, BASE)
    for name, weights in WEIGHTS.items():
        delta = np.abs(weights.astype(np.float64) - BASE[name])
        bound = delta * 2.0**-11 + np.abs(weights) * FLOAT32_EPS + 1e-12
        assert np.all(np.abs(decoded[name] - weights) <= bound), name
        assert decoded[name].dtype == np.float32


@pytest.mark.parametrize("scales", ["tensor", "channel"])
def test_int8_delta_is_within_half_a_scale_step(scales: str) -> None:
    encoded, _ = UpdateCodec("int8-delta", scales).encode(WEIGHTS, BASE)
    decoded = decode_update(encoded, BASE)
    for name, weights in WEIGHTS.items():
        scale = encoded.scales[name]
        assert encoded.tensors[name].dtype == np.int8 and scale.dtype == np.float32
        per_entry = scale.reshape(-1, *[1] * (weights.ndim - 1)) if scale.ndim else scale
        bound = per_entry / 2 * (1 + 1e-6) + np.abs(weights) * FLOAT32_EPS
        assert np.all(np.abs(decoded[name] - weights) <= bound), name
    channels = "channel" if scales == "channel" else "tensor"
    assert encoded.scales["conv.weight"].shape == ((4,) if channels == "channel" else ())
    assert encoded.scales["fc.bias"].shape == () and encoded.scales["temperature"].shape == ()


def test_per_channel_scales_follow_each_channel_and_beat_one_scale_on_small_channels() -> None:
    delta = WEIGHTS["conv.weight"].astype(np.float64) - BASE["conv.weight"]
    per_channel, _ = UpdateCodec("int8-delta", "channel").encode(WEIGHTS, BASE)
    per_tensor, _ = UpdateCodec("int8-delta").encode(WEIGHTS, BASE)
    peaks = np.abs(delta).reshape(4, -1).max(axis=1)
    np.testing.assert_allclose(per_channel.scales["conv.weight"], peaks / 127, rtol=1e-6)
    np.testing.assert_allclose(per_tensor.scales["conv.weight"], peaks.max() / 127, rtol=1e-6)
    errors = [
        np.abs(decode_update(e, BASE)["conv.weight"][3] - WEIGHTS["conv.weight"][3]).max()
        for e in (per_channel, per_tensor)
    ]
    assert errors[0] < errors[1] / 10


def test_an_unchanged_tensor_gets_a_positive_scale_and_decodes_exactly() -> None:
    weights = {**WEIGHTS, "fc.bias": BASE["fc.bias"].copy()}
    encoded, _ = UpdateCodec("int8-delta").encode(weights, BASE)
    assert encoded.scales["fc.bias"] == np.float32(1.0) and not encoded.tensors["fc.bias"].any()
    assert np.array_equal(decode_update(encoded, BASE)["fc.bias"], BASE["fc.bias"])


def test_top_k_sends_the_k_largest_magnitudes_with_their_ascending_indices() -> None:
    base = {"w": np.zeros(6, dtype=np.float32)}
    weights = {"w": np.array([0.1, -5.0, 0.2, 3.0, -0.05, 1.0], dtype=np.float32)}
    encoded, residual = UpdateCodec("fp16-delta", top_k=0.5).encode(weights, base)
    assert encoded.indices["w"].tolist() == [1, 3, 5] and encoded.indices["w"].dtype == np.uint16
    assert encoded.tensors["w"].tolist() == [-5.0, 3.0, 1.0]
    np.testing.assert_allclose(residual["w"], [0.1, 0.0, 0.2, 0.0, -0.05, 0.0], atol=1e-7)
    assert decode_update(encoded, base)["w"].tolist() == [0.0, -5.0, 0.0, 3.0, 0.0, 1.0]


@pytest.mark.parametrize("encoding", ["fp16-delta", "int8-delta"])
def test_error_feedback_sends_what_was_left_out_in_later_rounds(encoding: str) -> None:
    """Over rounds, what was sent plus the residual is what the device learned; an entry top-k leaves out in
    round 0 is sent in round 1, once the other entries have less to send."""
    codec = UpdateCodec(encoding, "channel" if encoding == "int8-delta" else "tensor", top_k=0.25)
    base, residual = base_weights(), None
    sent_total = {name: np.zeros(a.shape) for name, a in base.items()}
    true_total = {name: np.zeros(a.shape) for name, a in base.items()}
    left_out = []
    for round_id in range(6):
        weights = trained(base, seed=round_id)
        bias_step = [1.0, 0.9, 0.1, 0.0, 0.0] if round_id == 0 else [0.05, 0.05, 0.0, 0.0, 0.0]
        weights["fc.bias"] = base["fc.bias"] + np.array(bias_step, dtype=np.float32)
        encoded, residual = codec.encode(weights, base, residual)
        sent = decode_delta(encoded, spec_of(base))
        left_out.append(sent["fc.bias"][2])
        for name in base:
            sent_total[name] += sent[name]
            true_total[name] += weights[name].astype(np.float64) - base[name]
        base = {name: (base[name] + sent[name]).astype(np.float32) for name in base}
    for name in base:
        np.testing.assert_allclose(sent_total[name] + residual[name], true_total[name], atol=1e-5)
    assert left_out[0] == 0 and left_out[1] == pytest.approx(0.1, rel=0.01)


def test_the_residual_survives_a_restart_and_is_dropped_for_another_layout(tmp_path: Path) -> None:
    codec = UpdateCodec("int8-delta", top_k=0.2)
    first = encode_update(WEIGHTS, BASE, codec, ResidualStore(tmp_path))
    assert (tmp_path / RESIDUAL_FILE).is_file()
    kept = ResidualStore(tmp_path).load(BASE)
    assert kept is not None
    _, expected = codec.encode(WEIGHTS, BASE)
    assert all(np.array_equal(kept[name], expected[name]) for name in BASE)
    second = encode_update(WEIGHTS, BASE, codec, ResidualStore(tmp_path))
    assert any(not np.array_equal(first.tensors[n], second.tensors[n]) for n in BASE), "the residual was added"
    assert ResidualStore(tmp_path).load({"other": np.zeros(3, np.float32)}) is None
    (tmp_path / RESIDUAL_FILE).write_bytes(b"not an npz")
    assert ResidualStore(tmp_path).load(BASE) is None


def test_without_top_k_no_residual_is_kept(tmp_path: Path) -> None:
    encode_update(WEIGHTS, BASE, UpdateCodec("int8-delta"), ResidualStore(tmp_path))
    assert not (tmp_path / RESIDUAL_FILE).exists()


@pytest.mark.parametrize(
    ("codec", "message"),
    [
        (UpdateCodec("zip"), "unknown update encoding 'zip'"),
        (UpdateCodec("int8-delta", "row"), "update scales must be one of tensor, channel"),
        (UpdateCodec("fp16-delta", "channel"), "per-channel scales need the int8-delta encoding"),
        (UpdateCodec("int8-delta", top_k=1.0), "must lie in [0, 1)"),
        (UpdateCodec("int8-delta", top_k=-0.1), "must lie in [0, 1)"),
        (UpdateCodec("float32", top_k=0.1), "needs fp16-delta or int8-delta"),
    ],
)
def test_a_recipe_codec_that_does_not_fit_is_refused(codec: UpdateCodec, message: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        codec.checked()
    assert message in str(info.value)


# --- the wire ---------------------------------------------------------------------------------------------------


def update_of(encoded: Encoded, **changes) -> messages.Update:
    """An update of round 3 from the base carrying `encoded`; keyword arguments replace fields."""
    update = messages.Update(
        device_id="dev-1",
        round_id=3,
        update_id="u-3",
        base_hash=weights_hash(BASE),
        num_samples=10,
        class_counts=[5, 5],
        acquired_labels=10,
        metrics={},
        tensors=encoded.tensors,
        encoding=encoded.encoding,
        scales=encoded.scales,
        indices=encoded.indices,
    )
    return dataclasses.replace(update, **changes)


def test_a_float32_update_has_the_bytes_it_had_before_encodings() -> None:
    update = update_of(UpdateCodec().encode(WEIGHTS, BASE)[0], nonce=b"n")
    fields = ["device_id", "round_id", "update_id", "base_hash", "num_samples", "class_counts", "acquired_labels"]
    raw = {"v": wire.WIRE_VERSION, "kind": "update", **{f: getattr(update, f) for f in fields}, "metrics": {}}
    raw["tensors"] = {name: wire.encode_tensor(array) for name, array in WEIGHTS.items()}
    raw |= {"nonce": b"n", "signature": b""}
    assert wire.encode(update) == msgpack.packb(raw, use_bin_type=True)
    recipe = wire.encode(messages.RoundAnnouncement("r", 1, "h", messages.Recipe(), 0.0))
    assert b"update_" not in recipe


@pytest.mark.parametrize("codec", [UpdateCodec("fp16-delta"), UpdateCodec("int8-delta", "channel", 0.3)])
def test_an_encoded_update_and_its_recipe_round_trip_on_the_wire(codec: UpdateCodec) -> None:
    encoded, _ = codec.encode(WEIGHTS, BASE)
    decoded = wire.decode(wire.encode(update_of(encoded)), messages.Update)
    assert decoded.encoding == codec.encoding
    assert all(np.array_equal(decoded.tensors[n], encoded.tensors[n]) for n in encoded.tensors)
    assert all(np.array_equal(decoded.scales[n], encoded.scales[n]) for n in encoded.scales)
    assert all(np.array_equal(decoded.indices[n], encoded.indices[n]) for n in encoded.indices)
    recipe = messages.Recipe(update_encoding=codec.encoding, update_scales=codec.scales, update_top_k=codec.top_k)
    announced = wire.decode(
        wire.encode(messages.RoundAnnouncement("r", 1, "h", recipe, 0.0)), messages.RoundAnnouncement
    )
    assert UpdateCodec.of(announced.recipe) == codec


def test_int8_updates_are_about_a_quarter_of_float32_on_the_wire() -> None:
    big_base = {"w": np.zeros((64, 256), np.float32), "b": np.zeros(64, np.float32)}
    big = trained(big_base)
    sizes = {
        c.encoding + c.scales: len(wire.encode(update_of(c.encode(big, big_base)[0])))
        for c in (
            UpdateCodec(),
            UpdateCodec("fp16-delta"),
            UpdateCodec("int8-delta"),
            UpdateCodec("int8-delta", "channel"),
        )
    }
    assert sizes["fp16-deltatensor"] <= 0.51 * sizes["float32tensor"]
    assert sizes["int8-deltatensor"] <= 0.26 * sizes["float32tensor"]
    assert sizes["int8-deltachannel"] <= 0.27 * sizes["float32tensor"]


# --- rejections at the coordinator --------------------------------------------------------------------------------

EXPECTATION = Expectation(3, weights_hash(BASE), spec_of(BASE), 2, 1 << 20, base=BASE)
INT8 = UpdateCodec("int8-delta", "channel").encode(WEIGHTS, BASE)[0]
SPARSE = UpdateCodec("int8-delta", "channel", 0.5).encode(WEIGHTS, BASE)[0]


def rejection(update: messages.Update) -> Rejection:
    """The Rejection validation gives the update (failing the test when it passes), its reason within the cap."""
    with pytest.raises(Rejection) as info:
        validate_update("dev-1", wire.encode(update), EXPECTATION)
    assert len(info.value.reason) <= MAX_REASON_CHARS
    return info.value


def replaced(encoded: Encoded, part: str, name: str, array: np.ndarray | None) -> Encoded:
    """The encoded update with one entry of one part (tensors, scales, indices) replaced, or removed for None."""
    entries = dict(getattr(encoded, part))
    if array is None:
        del entries[name]
    else:
        entries[name] = array
    return dataclasses.replace(encoded, **{part: entries})


def test_a_valid_delta_update_is_decoded_to_float32_weights_against_the_base() -> None:
    update = validate_update("dev-1", wire.encode(update_of(INT8)), EXPECTATION)
    assert update.encoding == "float32" and not update.scales and not update.indices
    for name, weights in WEIGHTS.items():
        assert update.tensors[name].dtype == np.float32
        assert np.abs(update.tensors[name] - weights).max() <= INT8.scales[name].max() / 2 + 1e-6


@pytest.mark.parametrize(
    ("bad", "kind", "words"),
    [
        (np.float32(np.nan), RejectionKind.NON_FINITE, "scale of tensor 'fc.bias' is not finite (nan)"),
        (np.float32(np.inf), RejectionKind.NON_FINITE, "scale of tensor 'fc.bias' is not finite (inf)"),
        (np.float32(0.0), RejectionKind.OUT_OF_RANGE, "scale of tensor 'fc.bias' must be positive, got 0.0"),
        (np.float32(-0.5), RejectionKind.OUT_OF_RANGE, "must be positive, got -0.5"),
        (np.float64(0.1), RejectionKind.TENSOR_MISMATCH, "is float64 of shape ()"),
        (np.ones(3, np.float32), RejectionKind.TENSOR_MISMATCH, "of shape (3,); expected float32 of shape () or (5,)"),
    ],
)
def test_a_bad_scale_is_a_rejection_with_its_reason(bad: np.generic, kind: RejectionKind, words: str) -> None:
    refused = rejection(update_of(replaced(INT8, "scales", "fc.bias", np.asarray(bad))))
    assert refused.kind == kind and words in refused.reason


def test_one_bad_channel_scale_is_named() -> None:
    scales = INT8.scales["conv.weight"].copy()
    scales[2] = np.nan
    refused = rejection(update_of(replaced(INT8, "scales", "conv.weight", scales)))
    assert refused.kind == RejectionKind.NON_FINITE and "'conv.weight' is not finite" in refused.reason


def test_a_finite_scale_so_large_the_weights_overflow_is_non_finite() -> None:
    refused = rejection(update_of(replaced(INT8, "scales", "fc.bias", np.asarray(np.float32(3e38)))))
    assert refused.kind == RejectionKind.NON_FINITE and "fc.bias" in refused.reason


@pytest.mark.parametrize(
    ("encoded", "kind", "words"),
    [
        (dataclasses.replace(INT8, encoding="zstd"), RejectionKind.BAD_ENCODING, "unknown update encoding 'zstd'"),
        (replaced(INT8, "scales", "fc.bias", None), RejectionKind.BAD_ENCODING, "scales: missing ['fc.bias']"),
        (
            dataclasses.replace(UpdateCodec("fp16-delta").encode(WEIGHTS, BASE)[0], scales=INT8.scales),
            RejectionKind.BAD_ENCODING,
            "fp16-delta scales: missing [], unexpected",
        ),
        (dataclasses.replace(INT8, encoding="float32"), RejectionKind.BAD_ENCODING, "neither scales nor indices"),
        (replaced(INT8, "tensors", "fc.bias", None), RejectionKind.TENSOR_MISMATCH, "missing ['fc.bias']"),
        (
            replaced(INT8, "tensors", "fc.bias", np.zeros(5, np.float32)),
            RejectionKind.TENSOR_MISMATCH,
            "tensor 'fc.bias' is float32, not int8",
        ),
        (
            replaced(INT8, "tensors", "fc.bias", np.zeros(4, np.int8)),
            RejectionKind.TENSOR_MISMATCH,
            "tensor 'fc.bias' has shape (4,), expected (5,)",
        ),
    ],
)
def test_a_malformed_encoding_is_a_rejection(encoded: Encoded, kind: RejectionKind, words: str) -> None:
    refused = rejection(update_of(encoded))
    assert refused.kind == kind and words in refused.reason


@pytest.mark.parametrize(
    ("indices", "values", "kind", "words"),
    [
        (np.array([0, 5], np.uint16), 2, RejectionKind.OUT_OF_RANGE, "span [0, 5], outside [0, 5)"),
        (np.array([-1, 2], np.int32), 2, RejectionKind.OUT_OF_RANGE, "span [-1, 2], outside [0, 5)"),
        (np.array([1, 1, 3], np.uint16), 3, RejectionKind.BAD_ENCODING, "repeat an entry"),
        (np.array([3, 1], np.uint16), 2, RejectionKind.BAD_ENCODING, "are not in ascending order"),
        (np.arange(6, dtype=np.uint16), 6, RejectionKind.OUT_OF_RANGE, "k=6 exceeds the tensor's 5 entries"),
        (np.array([0.0, 1.0], np.float32), 2, RejectionKind.BAD_ENCODING, "must be one axis of integers, got float32"),
        (np.array([[0, 1]], np.uint16), 2, RejectionKind.BAD_ENCODING, "must be one axis of integers"),
        (np.array([0, 1], np.uint16), 3, RejectionKind.TENSOR_MISMATCH, "has shape (3,), expected (2,)"),
    ],
)
def test_bad_sparse_indices_are_a_rejection(indices: np.ndarray, values: int, kind: RejectionKind, words: str) -> None:
    encoded = replaced(replaced(SPARSE, "indices", "fc.bias", indices), "tensors", "fc.bias", np.ones(values, np.int8))
    refused = rejection(update_of(encoded))
    assert refused.kind == kind and words in refused.reason
    assert "indices of tensor 'fc.bias'" in refused.reason or kind == RejectionKind.TENSOR_MISMATCH


def test_indices_for_a_tensor_the_model_lacks_are_a_rejection() -> None:
    refused = rejection(update_of(replaced(SPARSE, "indices", "ghost", np.array([0], np.uint16))))
    assert refused.kind == RejectionKind.BAD_ENCODING and "['ghost']" in refused.reason


def test_reasons_stay_short_whatever_the_names_sent() -> None:
    long_name = "x" * 5000
    tensors = {**INT8.tensors, **{f"{long_name}{i}": np.zeros(1, np.int8) for i in range(200)}}
    refused = rejection(update_of(dataclasses.replace(INT8, tensors=tensors)))
    assert refused.kind == RejectionKind.TENSOR_MISMATCH and "unexpected ['xxxxxxxx" in refused.reason
    scales = {**INT8.scales, long_name: np.ones((), np.float32)}
    assert rejection(update_of(dataclasses.replace(INT8, scales=scales))).kind == RejectionKind.BAD_ENCODING


def test_a_rejected_delta_is_not_absorbed_and_the_device_may_send_a_good_one() -> None:
    absorbed = []
    collector = RoundCollector(EXPECTATION, absorbed.append)
    bad = update_of(replaced(INT8, "scales", "temperature", np.asarray(np.float32(np.nan))))
    with pytest.raises(Rejection):
        offer(collector, "dev-1", wire.encode(bad))
    assert absorbed == [] and collector.accepted == {}
    update, is_new = offer(collector, "dev-1", wire.encode(update_of(INT8)))
    assert is_new and update.update_id == "u-3" and [a.device_id for a in absorbed] == ["dev-1"]
    assert absorbed[0].weights["temperature"].dtype == np.float32


def test_both_commands_take_the_encoding_flags_and_refuse_a_bad_one_in_one_line(tmp_path: Path) -> None:
    for module, command in (("coordinator", "run"), ("bench", "simulate")):
        help_text = subprocess.run(
            [sys.executable, "-m", module, command, "--help"], capture_output=True, text=True, check=True
        ).stdout
        assert all(flag in help_text for flag in ("--update-encoding", "--update-scales", "--update-top-k"))
    result = subprocess.run(
        [sys.executable, "-m", "bench", "simulate", "--devices", "2", "--rounds", "1"]
        + ["--run-dir", str(tmp_path / "run"), "--update-top-k", "0.1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "top-k sends a sparse delta: it needs fp16-delta or int8-delta" in result.stderr


# --- through a real broker ----------------------------------------------------------------------------------------


def one_round(run_dir: Path, broker: EmbeddedBroker, encoding: str, compression: str = "none") -> Path:
    """One round of two real agent processes sending `encoding` updates (deflated or not); the accepted updates are
    kept."""
    recipe = messages.Recipe(sampler="random", labels_per_acquisition=20, epochs=1, mc_passes=2, batch_size=20)
    settings = ServerSettings(
        run_dir=run_dir,
        fleet=f"codec-{encoding}-{compression}",
        recipe=dataclasses.replace(recipe, update_encoding=encoding, update_compression=compression),
        policy=RoundPolicy(rounds=1, min_devices=2, quorum=2, round_timeout=120),
        init=InitSettings(samples=50, epochs=2),
        validation_samples=100,
        test_samples=300,
        evaluate_devices=False,
        ship_bundles=False,
        keep_updates=True,
    )
    simulate(settings, BenchSettings(devices=2, partition="type1", pool_size=100), lambda result: None, broker.address)
    return run_dir


@pytest.mark.integration
def test_int8_deltas_through_a_real_broker_give_the_float32_model_within_half_a_scale_step(tmp_path: Path) -> None:
    """The same seeded round twice, devices sending float32 weights, then int8 deltas: the committed model differs
    by at most half the largest scale step of any device, each int8 update is about a quarter of the bytes, and the
    per-layer divergence (measured on the decoded updates kept in the round's scratch) is the float32 run's. Deflate is lossless: the
    same int8 round deflated commits the same model bit for bit, in fewer bytes still."""
    with EmbeddedBroker(tmp_path / "broker") as broker:
        runs = {encoding: one_round(tmp_path / encoding, broker, encoding) for encoding in ("float32", "int8-delta")}
        deflated = one_round(tmp_path / "deflated", broker, "int8-delta", "deflate")
    with RunStore(deflated) as store:
        assert [(r.accepted, r.rejected) for r in store.rounds()] == [(2, 0)]
        packed_model, packed_sizes = store.checkpoints.load(1), [d.update_bytes for d in store.device_rounds(1)]
    models, sizes, divergences = {}, {}, {}
    for encoding, run_dir in runs.items():
        with RunStore(run_dir) as store:
            assert [(r.round_id, r.accepted, r.rejected) for r in store.rounds()] == [(1, 2, 0)]
            models[encoding] = store.checkpoints.load(1)
            sizes[encoding] = [d.update_bytes for d in store.device_rounds(1)]
            divergences[encoding] = [d.divergence for d in store.device_rounds(1)]
            spooled = [wire.decode(p, messages.Update) for p in store.spool.payloads(1).values()]
        assert {u.encoding for u in spooled} == {encoding}
    assert all(b <= 0.27 * a for a, b in zip(sizes["float32"], sizes["int8-delta"], strict=True))
    for exact, measured in zip(divergences["float32"], divergences["int8-delta"], strict=True):
        assert measured == pytest.approx(exact, rel=0.02), "divergence is measured on the decoded deltas"
    for name, weights in models["float32"].items():
        half_step = max(float(u.scales[name].max()) for u in spooled) / 2
        assert 0 < np.abs(models["int8-delta"][name] - weights).max() <= half_step * 1.001 + 1e-6, name
    assert weights_hash(packed_model) == weights_hash(models["int8-delta"])
    assert all(b < 0.8 * a for a, b in zip(sizes["int8-delta"], packed_sizes, strict=True))


@pytest.mark.integration
def test_a_restarted_coordinator_decodes_a_spooled_delta_against_the_rounds_base(tmp_path: Path, broker) -> None:
    """The spool keeps the raw int8 payload; a new coordinator process opening the round takes it back through the
    same checks, and its streamed aggregate and divergence read the payload back decoded against the base."""
    base = get_weights(build_model(seed=0))
    device_weights = {name: (array + 0.01).astype(np.float32) for name, array in base.items()}
    encoded = UpdateCodec("int8-delta", "channel").encode(device_weights, base)[0]
    update = dataclasses.replace(
        update_of(encoded, round_id=1, base_hash=weights_hash(base), class_counts=[1] * 10), device_id="dev-a"
    )
    session = MqttSession(broker.address, client_id="coordinator")
    split = LabelledSplit.from_uint8(np.zeros((2, 28, 28), np.uint8), np.zeros(2, np.int64))
    with RunStore(tmp_path / "run") as store:
        store.spool.add(1, "dev-a", wire.encode(update))
        evaluator = Evaluator(DEFAULT_SPEC, split, split, 1, 0)
        coordinator = local_coordinator("codec", session, store, make_strategy("avefl"), evaluator, RoundPolicy(1))
        session.connect(timeout=10)
        opened = coordinator.open(1, base, TensorScratch(store.spool.folder))
        assert list(opened.collector.accepted) == ["dev-a"] and opened.collector.rejected == {}
        aggregate = opened.aggregator.finish(None)
    session.close()
    for name, weights in device_weights.items():
        assert np.abs(aggregate.weights[name] - weights).max() <= encoded.scales[name].max() / 2 + 1e-6, name
    assert max(aggregate.divergence["dev-a"].values()) < 1e-6
