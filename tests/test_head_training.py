# Head-only training: the numpy classifier step against torch's SGD, the budget check, and a torch-free Pi Zero agent.
from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from fleet import WITHOUT_TORCH, announce_round, fleet_shards, log_text, wait_until

from bench.simulate import BenchSettings, agent_command
from edge_agent.learning.bundle import store_bundle
from edge_agent.learning.head_learner import HEAD_BODIES
from edge_agent.learning.head_training import HeadSettings, cross_entropy_gradients, train_classifier
from edge_agent.learning.learner_choice import round_problem
from edge_agent.learning.local_data import LocalData
from edge_agent.learning.local_rules import CLASSIFIER_ONLY, FULL_MODEL, LOCAL_RULES, KeptLabels, SupervisedRule
from edge_agent.learning.models import build_model, get_weights
from edge_agent.learning.torch_rules import TORCH_BODIES
from edge_agent.loop.agent_settings import AgentSettings
from edge_agent.loop.memory_budget import MemoryBudgetError, estimated_peak_mb, fit_to_budget
from export.bundle_writer import ensure_bundle_files
from protocol import messages, topics, wire
from protocol.dp import DP_SGD_EPSILON_METRIC
from protocol.dp_accountant import SampledGaussian, epsilon_of
from protocol.model_spec import load_model_spec
from protocol.mqtt import BrokerAddress, MqttSession

ROOT = Path(__file__).resolve().parent.parent
PI_ZERO = ROOT / "firmware_configs" / "raspberry-pi-zero-2w.toml"


def test_the_gradient_of_one_sample_is_probabilities_minus_the_one_hot_label() -> None:
    features = np.array([[1.0, 2.0]])
    weight, bias = np.zeros((3, 2)), np.zeros(3)
    loss, grad_weight, grad_bias = cross_entropy_gradients(features, np.array([1]), weight, bias)
    assert loss == pytest.approx(np.log(3.0))
    expected = np.array([1 / 3, 1 / 3 - 1, 1 / 3])
    assert np.allclose(grad_bias, expected) and np.allclose(grad_weight, np.outer(expected, [1.0, 2.0]))


def test_full_batch_training_matches_torch_sgd_with_momentum_and_weight_decay() -> None:
    rng = np.random.default_rng(0)
    features, labels = rng.normal(size=(12, 5)).astype(np.float32), rng.integers(0, 3, 12)
    weight, bias = rng.normal(size=(3, 5)).astype(np.float32), rng.normal(size=3).astype(np.float32)
    settings = HeadSettings(epochs=4, batch_size=12, learning_rate=0.1, momentum=0.9, weight_decay=0.01)
    new_weight, new_bias, _ = train_classifier(features, labels, weight, bias, settings)
    layer = torch.nn.Linear(5, 3).double()
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(weight.astype(np.float64)))
        layer.bias.copy_(torch.from_numpy(bias.astype(np.float64)))
    optimiser = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    for _ in range(4):
        optimiser.zero_grad()
        torch.nn.functional.cross_entropy(
            layer(torch.from_numpy(features).double()), torch.from_numpy(labels)
        ).backward()
        optimiser.step()
    assert np.allclose(new_weight, layer.weight.detach().numpy(), atol=1e-5)
    assert np.allclose(new_bias, layer.bias.detach().numpy(), atol=1e-5)


def test_the_logit_adjusted_head_step_matches_torch_on_the_adjusted_loss() -> None:
    rng = np.random.default_rng(4)
    features, labels = rng.normal(size=(10, 5)).astype(np.float32), np.array([0] * 7 + [1] * 3)
    weight, bias = rng.normal(size=(3, 5)).astype(np.float32), rng.normal(size=3).astype(np.float32)
    adjustment = KeptLabels().logit_bias(labels, 3, messages.Recipe(options={"logit_adjustment": 1.0}))
    assert adjustment is not None and adjustment[2] == -np.inf
    assert np.allclose(adjustment[:2], np.log([7.0, 3.0]))
    assert KeptLabels().logit_bias(labels, 3, messages.Recipe()) is None
    settings = HeadSettings(epochs=3, batch_size=10, learning_rate=0.1, momentum=0.9)
    new_weight, new_bias, _ = train_classifier(features, labels, weight, bias, settings, adjustment)
    layer = torch.nn.Linear(5, 3).double()
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(weight.astype(np.float64)))
        layer.bias.copy_(torch.from_numpy(bias.astype(np.float64)))
    optimiser = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        optimiser.zero_grad()
        logits = layer(torch.from_numpy(features).double()) + torch.from_numpy(adjustment)
        torch.nn.functional.cross_entropy(logits, torch.from_numpy(labels)).backward()
        optimiser.step()
    assert np.allclose(new_weight, layer.weight.detach().numpy(), atol=1e-5)
    assert np.allclose(new_bias, layer.bias.detach().numpy(), atol=1e-5)
    assert np.array_equal(new_weight[2], weight[2]) and not np.allclose(new_weight[:2], weight[:2])


def test_a_separable_problem_is_learned_with_dropout_on_the_features() -> None:
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 4, 400)
    features = (np.eye(4)[labels] * 3.0 + rng.normal(scale=0.3, size=(400, 4))).astype(np.float32)
    settings = HeadSettings(epochs=30, batch_size=32, learning_rate=0.1, dropout=0.5, seed=3)
    weight, bias, loss = train_classifier(
        features, labels, np.zeros((4, 4), np.float32), np.zeros(4, np.float32), settings
    )
    assert np.mean(np.argmax(features @ weight.T + bias, axis=1) == labels) > 0.98 and loss < 0.8 < np.log(4)


def test_the_budget_shrinks_the_scoring_batch_or_refuses_with_the_numbers() -> None:
    head = AgentSettings("f", "d", profile="small", trainer="head", inference_batch=256)
    assert fit_to_budget(head, 160, 4000).inference_batch == 128
    assert fit_to_budget(head, 1000, 4000).inference_batch == 256
    camera = dataclasses.replace(head, inference_batch=4)  # a profile's small batch is kept, never raised
    assert fit_to_budget(camera, 200, 4000).inference_batch == 4
    with pytest.raises(MemoryBudgetError, match="memory_budget_mb = 160 of profile 'small' is below the ~"):
        fit_to_budget(AgentSettings("f", "d", profile="small", trainer="full"), 160, 4000)


def test_a_camera_backbones_budget_counts_its_session_and_feature_rows() -> None:
    """EfficientNet-Lite0 on the Pi Zero 2 W profile peaked at 152 MB with 500 pool images and 176 MB with 4000
    (docs/field.md): the estimate lies at or above both, within the profile's 200 MB at its 4000-image cap, and a
    160 MB budget, which the 28x28 count (96 MB at 4000) would have passed, is refused with the numbers."""
    camera = load_model_spec(ROOT / "examples" / "camera-efficientnet.toml").spec
    assert 152 <= estimated_peak_mb("head", 500, 4, camera) < 160
    assert 176 <= estimated_peak_mb("head", 4000, 4, camera) <= 200
    assert estimated_peak_mb("head", 4000, 4) < 100  # the paper CNN's pool, as measured for it
    settings = AgentSettings("f", "d", profile="pi-zero", trainer="head", inference_batch=4)
    assert fit_to_budget(settings, 200, 4000, camera).inference_batch == 4
    with pytest.raises(MemoryBudgetError, match=r"160 of profile 'pi-zero' is below the ~18\d MB a 'head' trainer of "):
        fit_to_budget(settings, 160, 4000, camera)


def test_a_head_only_device_refuses_what_needs_the_whole_model_with_a_reason(tmp_path: Path) -> None:
    head, full = AgentSettings("f", "d", trainer="head").compute, AgentSettings("f", "d").compute
    bundle = store_bundle(
        tmp_path / "bundle", ensure_bundle_files(get_weights(build_model(seed=0)), tmp_path / "export")
    )
    online = messages.Recipe(sampler="entropy")
    assert round_problem(head, online, bundle) is None and round_problem(full, online, None) is None
    assert round_problem(head, messages.Recipe(local_rule="fedprox"), bundle) == (
        "local rule 'fedprox' trains the whole model; this profile trains the classifier only"
    )
    assert round_problem(head, messages.Recipe(sampler="ksas"), bundle) == (
        "sampler 'ksas' compares whole-model logits; this profile trains the classifier only"
    )
    old = dataclasses.replace(bundle, manifest=dataclasses.replace(bundle.manifest, head=None))
    assert (
        round_problem(head, online, old)
        == "the round's bundle has no penultimate graph (exported before head-only training)"
    )


class NewestLabels(SupervisedRule):
    """A toy supervised rule: this acquisition's new labels only."""

    name = "newest-labels"
    summary = "a test rule"

    def training_set(self, data: LocalData, recipe: messages.Recipe, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """The new batch."""
        return data.new_images, data.new_labels


def test_a_head_only_device_accepts_a_rule_by_what_it_declares_not_by_its_name(tmp_path: Path) -> None:
    head = AgentSettings("f", "d", trainer="head").compute
    bundle = store_bundle(
        tmp_path / "bundle", ensure_bundle_files(get_weights(build_model(seed=0)), tmp_path / "export")
    )
    recipe = messages.Recipe(sampler="entropy", local_rule=NewestLabels.name)
    assert round_problem(head, recipe, bundle) == (
        "local rule 'newest-labels' trains the whole model; this profile trains the classifier only"
    )
    LOCAL_RULES.register(NewestLabels)
    try:
        assert round_problem(head, recipe, bundle) is None
        assert HEAD_BODIES.body(NewestLabels()) is HEAD_BODIES.body(KeptLabels())
    finally:
        LOCAL_RULES.unregister(NewestLabels.name)


def test_every_rule_has_a_body_on_each_trainer_it_declares_and_none_on_the_others() -> None:
    for name, rule in LOCAL_RULES.items():
        for trainer, bodies in ((FULL_MODEL, TORCH_BODIES), (CLASSIFIER_ONLY, HEAD_BODIES)):
            if trainer in rule.trainers:
                assert callable(bodies.body(rule())), name
            else:
                with pytest.raises(ValueError, match=f"local rule {name!r} does not run on the {trainer!r} trainer"):
                    bodies.body(rule())


def test_an_agent_whose_profile_cannot_hold_its_trainer_refuses_to_start_in_one_line(tmp_path: Path) -> None:
    profile = tmp_path / "tight.toml"
    profile.write_text(PI_ZERO.read_text().replace('trainer = "head"', 'trainer = "full"'))
    [launch] = fleet_shards(tmp_path, 1)
    command = agent_command(launch, BrokerAddress("127.0.0.1", 1), "tight", BenchSettings(agent_profile=profile))
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr[-2000:]
    assert (
        done.stderr.startswith(
            "fl-bench: memory_budget_mb = 200 of profile 'raspberry-pi-zero-2w' is below the ~381 MB a 'full' trainer of paper-cnn needs with a pool of 250 images"
        )
        and "(a 'head' trainer needs no torch)" in done.stderr
    )


@pytest.mark.integration
@pytest.mark.parametrize("rule", ["kept-labels", "dp-sgd"])
def test_a_pi_zero_agent_trains_the_classifier_without_torch(tmp_path: Path, broker, processes, rule: str) -> None:
    [launch] = fleet_shards(tmp_path, 1)
    listener = MqttSession(broker.address, client_id="head-listener", session_expiry=0)
    listener.connect(timeout=10)
    listener.subscribe(topics.UPDATE.filter(fleet="head"))
    command = agent_command(launch, broker.address, "head", BenchSettings(agent_profile=PI_ZERO))
    with open(launch.log_file, "wb") as output:
        processes.append(
            subprocess.Popen(
                [sys.executable, "-c", WITHOUT_TORCH, *command[2:]],
                stdout=output,
                stderr=subprocess.STDOUT,
                env=os.environ,
            )
        )
    recipe = messages.Recipe(labels_per_acquisition=20, epochs=3, batch_size=8, mc_passes=3, local_rule=rule)
    announce_round(broker.address, "head", recipe, bundle_dir=tmp_path / "bundle")
    deadline, message = time.monotonic() + 120, None
    while message is None and time.monotonic() < deadline:
        message = listener.next_message(timeout=0.5)
    assert message is not None, log_text(launch.log_file)[-3000:]
    update, base = wire.decode(message.payload, messages.Update), get_weights(build_model(seed=1))
    changed = sorted(name for name in base if not np.array_equal(update.tensors[name], base[name]))
    assert changed == ["fc2.bias", "fc2.weight"] and update.acquired_labels == 20
    if rule == "dp-sgd":  # 3 epochs of ceil(n / 8) Poisson steps at q = 8 / n over the n labels the device holds
        held = update.num_samples
        spent = epsilon_of([SampledGaussian(8 / held, 1.0)] * (3 * math.ceil(held / 8)), 1e-5)
        assert update.metrics[DP_SGD_EPSILON_METRIC] == pytest.approx(spent, rel=1e-9)
    wait_until(lambda: "footprint round=1" in log_text(launch.log_file), "the footprint line")
    listener.close()
