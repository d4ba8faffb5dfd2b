# Test helper: a coordinator assembled from its parts around a given session, store, strategy and evaluator.
from __future__ import annotations

from coordinator.closing import RoundCloser
from coordinator.evaluation import Evaluator
from coordinator.intake import UpdateIntake
from coordinator.observer import RoundObserver
from coordinator.presence import Presence
from coordinator.publisher import Artefacts, RetainedPublisher
from coordinator.rounds import Coordinator, RoundParts, RoundPolicy, RoundRules
from coordinator.store import RunStore
from coordinator.strategies import Strategy
from edge_agent import wire
from edge_agent.mqtt import MqttSession


def local_coordinator(
    fleet: str,
    session: MqttSession,
    store: RunStore,
    strategy: Strategy,
    evaluator: Evaluator,
    policy: RoundPolicy,
    recipe: wire.Recipe | None = None,
) -> Coordinator:
    """A coordinator with no bundles, no encoder, no device evaluation and an observer that hears nothing."""
    observer = RoundObserver()
    parts = RoundParts(
        presence=Presence(observer),
        intake=UpdateIntake(fleet, session, store, observer),
        publisher=RetainedPublisher(session, fleet, "run", Artefacts()),
        closer=RoundCloser(store, strategy, evaluator, evaluate_devices=False, base_labels=0),
        observer=observer,
    )
    return Coordinator(fleet, session, RoundRules(recipe or wire.Recipe(), policy), parts)
