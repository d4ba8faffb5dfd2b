# A frozen backbone travels once: its prefix graphs are retained by sha256, models and bundles carry the rest.
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import pytest
from fleet import pi_zero_fleet
from onnx import numpy_helper

from bench.simulate import simulate
from coordinator.relay import RELAY_STRATEGY, Relay, RelaySettings, SiteRounds
from coordinator.rounds.publisher import Artefacts, RetainedPublisher, bundle_message, model_message, split_of
from coordinator.rounds.rules import RoundPolicy, RoundRules
from coordinator.setup.settings import ServerSettings
from coordinator.storage.store import RunStore
from edge_agent.learning.bundle import MANIFEST_NAME, bundle_weights, load_bundle
from edge_agent.learning.models import build_model, get_weights
from edge_agent.learning.onnx_initializers import OnnxGraphError, graph_weights
from edge_agent.loop.artefacts import RoundArtefacts
from edge_agent.loop.backbone_store import SUFFIX
from export.bundle_writer import ensure_bundle_files, write_bundle
from protocol import messages, topics, wire
from protocol.backbone import backbone_split
from protocol.files import load_arrays
from protocol.model_spec import ModelSpec, trainable_names
from protocol.mqtt import MqttSession
from protocol.tensors import Weights, weights_hash

WAIT = 20.0
HEAD_SPEC = ModelSpec("mobilenet", 3, 32, 32, [0.5] * 3, [0.25] * 3, ["a", "b", "c"], 0.25, trainable="head")


def model_of(spec: ModelSpec, seed: int = 0) -> Weights:
    """A zoo model's weights for a spec."""
    return get_weights(build_model(spec, seed=seed))


@pytest.fixture(scope="module")
def head_bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Weights, Path]:
    """A head-only MobileNet and its bundle folder, exported once for the module."""
    weights = model_of(HEAD_SPEC)
    folder = tmp_path_factory.mktemp("bundle")
    write_bundle(weights, folder, HEAD_SPEC)
    return weights, folder


def test_the_reader_takes_every_prefix_weight_as_onnx_itself_reads_it(head_bundle) -> None:
    weights, folder = head_bundle
    manifest = load_bundle(folder).manifest
    read = graph_weights((folder / "prefix.onnx").read_bytes())
    assert sorted(read) == sorted(manifest.initializers["prefix"].values())
    for initializer in onnx.load(str(folder / "prefix.onnx")).graph.initializer:
        weight = manifest.initializers["prefix"][initializer.name]
        assert np.array_equal(read[weight], numpy_helper.to_array(initializer))
        assert np.array_equal(read[weight], weights[weight]) and read[weight].dtype == np.float32


@pytest.mark.parametrize("data", [b"\x3a\xff", b"\x3a\x05abc", b"\x0f", b"\x3a\x03\x2a\x01\x00"])
def test_bytes_that_are_not_an_onnx_graph_of_raw_floats_are_refused(data: bytes) -> None:
    with pytest.raises(OnnxGraphError, match="ONNX graph"):
        graph_weights(data)


def test_a_frozen_bundle_keeps_the_prefix_weights_in_its_graph_only_and_still_gives_the_whole_model(
    head_bundle,
) -> None:
    weights, folder = head_bundle
    bundle = load_bundle(folder)
    assert sorted(load_arrays(bundle.weights_path)) == sorted(trainable_names(HEAD_SPEC, weights))
    whole = bundle_weights(bundle)
    assert weights_hash(whole) == weights_hash(weights) == bundle.manifest.weights_hash
    split = backbone_split(bundle.manifest)
    assert split is not None and split.files == {"prefix.onnx": bundle.manifest.files["prefix.onnx"]}
    assert split.held == frozenset(weights) - frozenset(trainable_names(HEAD_SPEC, weights))


@pytest.mark.parametrize("trainable", ["all", "last:1"])
def test_a_spec_that_trains_the_prefix_has_no_backbone_and_its_messages_are_as_before(tmp_path, trainable) -> None:
    spec = dataclasses.replace(HEAD_SPEC, trainable=trainable)
    weights = model_of(spec)
    files = ensure_bundle_files(weights, tmp_path / "bundle", spec)
    assert split_of(files) is None
    assert sorted(load_arrays(tmp_path / "bundle" / "weights.npz")) == sorted(weights)
    model_hash = weights_hash(weights)
    assert wire.encode(model_message(spec, weights, model_hash, None)) == wire.encode(
        messages.ModelMessage(model_hash, spec, weights)
    )
    assert wire.encode(bundle_message(files, model_hash, None)) == wire.encode(
        messages.BundleMessage(model_hash, files)
    )


def publisher_of(session: MqttSession, run_dir: Path, fleet: str = "f") -> RetainedPublisher:
    """A publisher of the head-only spec that exports each model's bundle under run_dir, as the coordinator does."""

    def files(weights: Weights, model_hash: str) -> dict[str, bytes]:
        return ensure_bundle_files(weights, run_dir / model_hash, HEAD_SPEC)

    return RetainedPublisher(session, fleet, "run", Artefacts(HEAD_SPEC, files))


def device_artefacts(session: MqttSession, state: Path, fleet: str = "f") -> RoundArtefacts:
    """A device's artefacts over a state folder, following the announced model and its bundle."""
    return RoundArtefacts(session, fleet, state / "bundles", state / "backbone")


def take_in(session: MqttSession, artefacts: RoundArtefacts, model_hash: str, timeout: float = WAIT) -> list[str]:
    """Follows a model and its bundle and hands the device what arrives until both are held; the topics seen."""
    announcement = messages.RoundAnnouncement("run", 1, model_hash, messages.Recipe(), 0.0)
    artefacts.follow_round(announcement, with_bundle=True)
    seen = []
    while not artefacts.ready(announcement, needs_bundle=True):
        message = session.next_message(timeout=timeout)
        assert message is not None, f"the device got nothing more; it holds {list(artefacts.models)}"
        seen.append(message.topic)
        kind = message.topic.split("/")[2]
        if artefacts.follows(kind, message.topic):
            artefacts.receive(kind, message.payload)
    return seen


def test_a_device_keeps_the_backbone_across_rounds_and_restarts_and_fetches_a_corrupt_copy_again(
    tmp_path, broker, sessions
) -> None:
    coordinator = sessions(broker.address, "coordinator")
    publisher = publisher_of(coordinator, tmp_path / "run")
    first = model_of(HEAD_SPEC)
    publisher.publish_model(first, weights_hash(first))
    backbone = split_of(ensure_bundle_files(first, tmp_path / "run" / weights_hash(first), HEAD_SPEC))
    assert backbone is not None
    backbone_topic = topics.BACKBONE.build(fleet="f", hash=backbone.graph)

    device = sessions(broker.address, "device")  # joins late: the backbone comes from its retained copy
    artefacts = device_artefacts(device, tmp_path / "state")
    assert backbone_topic in take_in(device, artefacts, weights_hash(first))
    assert weights_hash(artefacts.models[weights_hash(first)]) == weights_hash(first)
    stored = tmp_path / "state" / "backbone" / f"{backbone.graph}{SUFFIX}"
    assert stored.read_bytes() == (tmp_path / "state" / "bundles" / weights_hash(first) / "prefix.onnx").read_bytes()

    second = {**first, "classifier_fc.bias": first["classifier_fc.bias"] + 1.0}  # the next round: a new head
    publisher.publish_model(second, weights_hash(second))
    assert backbone_topic not in take_in(device, artefacts, weights_hash(second))
    assert (
        bundle_weights(artefacts.bundles[weights_hash(second)])["classifier_fc.bias"][0]
        == second["classifier_fc.bias"][0]
    )
    device.close()

    restarted = sessions(broker.address, "device-again")
    assert backbone_topic not in take_in(
        restarted, device_artefacts(restarted, tmp_path / "state"), weights_hash(second)
    )
    restarted.close()

    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0xFF
    stored.write_bytes(bytes(data))
    again = sessions(broker.address, "device-corrupt")
    artefacts = device_artefacts(again, tmp_path / "state")
    assert backbone_topic in take_in(again, artefacts, weights_hash(second))
    assert weights_hash(artefacts.models[weights_hash(second)]) == weights_hash(second)
    assert stored.read_bytes() != bytes(data)


def test_a_backbone_that_does_not_hash_to_its_name_is_never_stored(tmp_path, broker, sessions) -> None:
    coordinator = sessions(broker.address, "coordinator")
    publisher = publisher_of(coordinator, tmp_path / "run")
    weights = model_of(HEAD_SPEC)
    model_hash = weights_hash(weights)
    publisher.publish_model(weights, model_hash)
    split = split_of(ensure_bundle_files(weights, tmp_path / "run" / model_hash, HEAD_SPEC))
    assert split is not None
    topic = topics.BACKBONE.build(fleet="f", hash=split.graph)
    coordinator.publish(
        topic, wire.encode(messages.BackboneMessage(split.graph, b"not the graph")), retain=True, wait=WAIT
    )

    device = sessions(broker.address, "device")
    artefacts = device_artefacts(device, tmp_path / "state")
    with pytest.raises(AssertionError, match="got nothing more"):
        take_in(device, artefacts, model_hash, timeout=3.0)
    assert model_hash not in artefacts.models and not list((tmp_path / "state" / "backbone").glob("*"))
    assert artefacts.follows("backbone", topic), "the device keeps waiting for the real backbone"


def test_a_head_only_rounds_model_and_bundle_are_a_small_fraction_of_the_whole(tmp_path) -> None:
    weights = model_of(HEAD_SPEC)
    model_hash = weights_hash(weights)
    files = ensure_bundle_files(weights, tmp_path / "bundle", HEAD_SPEC)
    split = split_of(files)
    split_bytes = len(wire.encode(model_message(HEAD_SPEC, weights, model_hash, split))) + len(
        wire.encode(bundle_message(files, model_hash, split))
    )
    full_files = ensure_bundle_files(weights, tmp_path / "full", dataclasses.replace(HEAD_SPEC, trainable="all"))
    whole_bytes = len(wire.encode(messages.ModelMessage(model_hash, HEAD_SPEC, weights))) + len(
        wire.encode(messages.BundleMessage(model_hash, full_files))
    )
    assert split_bytes < 0.05 * whole_bytes, (split_bytes, whole_bytes)
    assert MANIFEST_NAME in bundle_message(files, model_hash, split).files


def run_head_only_fleet(run_dir: Path, monkeypatch, split: bool) -> tuple[list[str], dict[str, list[int]]]:
    """A 2-round head-only MobileNet run of 2 Pi Zero bench devices: its committed models' hashes and the bytes
    retained, by kind (`split` False: the publisher ships every tensor and file, as before the backbone existed)."""
    sizes: dict[str, list[int]] = {}
    retain = RetainedPublisher.retain_current

    def measured(self: RetainedPublisher, kind: str, topic: str, message) -> None:
        if topic != self._retained.get(kind):
            sizes.setdefault(kind.split(" ")[0], []).append(len(wire.encode(message())))
        retain(self, kind, topic, message)

    monkeypatch.setattr(RetainedPublisher, "retain_current", measured)
    if not split:
        monkeypatch.setattr("coordinator.rounds.publisher.split_of", lambda files: None)
    settings, bench = pi_zero_fleet(run_dir, "backbone", rounds=2, mc_passes=4)
    spec = ModelSpec("mobilenet", width_multiplier=0.25, trainable="head")
    simulate(dataclasses.replace(settings, spec=spec), bench, lambda result: None)
    store = RunStore(run_dir)
    try:
        models = [weights_hash(store.checkpoints.load(round_id)) for round_id in (0, 1, 2)]
    finally:
        store.close()
    return models, sizes


def test_a_head_only_fleet_downloads_the_backbone_once_and_commits_the_same_models(tmp_path, monkeypatch) -> None:
    with monkeypatch.context() as patch:
        whole_models, whole = run_head_only_fleet(tmp_path / "whole", patch, split=False)
    models, sizes = run_head_only_fleet(tmp_path / "split", monkeypatch, split=True)
    assert len(sizes["backbone"]) == 1 and len(sizes["model"]) == len(whole["model"]) == 2
    per_round = [model + bundle for model, bundle in zip(sizes["model"], sizes["bundle"])]
    whole_round = [model + bundle for model, bundle in zip(whole["model"], whole["bundle"])]
    assert max(per_round) < 0.2 * min(whole_round), (per_round, whole_round)
    assert models == whole_models and len(set(models)) == 3


def test_a_relay_completes_the_model_from_the_central_backbone_and_retains_it_again_for_its_site(
    tmp_path, broker, sessions
) -> None:
    central = sessions(broker.address, "central")
    weights = model_of(HEAD_SPEC)
    model_hash = weights_hash(weights)
    publisher = publisher_of(central, tmp_path / "central", "central")
    publisher.publish_model(weights, model_hash)

    upstream, site_session = sessions(broker.address, "relay-00"), sessions(broker.address, "relay-00-site")
    site = ServerSettings(run_dir=tmp_path / "relay", fleet="site", strategy=RELAY_STRATEGY, policy=RoundPolicy(1))
    store = RunStore(site.run_dir)
    rounds = SiteRounds(site, site_session, store, RoundRules(messages.Recipe(), site.policy))
    relay = Relay(RelaySettings("relay-00", "central", site), upstream, rounds, store)
    try:
        announcement = messages.RoundAnnouncement("run", 1, model_hash, messages.Recipe(), 0.0)
        relay.on_announcement(announcement)
        while not relay.artefacts.ready(announcement, needs_bundle=False):
            message = upstream.next_message(timeout=WAIT)
            assert message is not None, "the relay did not get its model"
            relay.handle(message)
        assert weights_hash(relay.artefacts.models[model_hash]) == model_hash
        assert list((tmp_path / "relay" / "upstream-backbone").glob(f"*{SUFFIX}"))

        rounds.parts.publisher.artefacts = rounds.artefacts(HEAD_SPEC, b"")
        rounds.parts.publisher.publish_model(relay.artefacts.models[model_hash], model_hash)
        device = sessions(broker.address, "site-device")
        artefacts = device_artefacts(device, tmp_path / "device", "site")
        assert topics.BACKBONE.build(fleet="site", hash=next(iter(relay.artefacts.fetch.in_use["model"]))) in take_in(
            device, artefacts, model_hash
        )
        assert weights_hash(artefacts.models[model_hash]) == model_hash
    finally:
        store.close()
