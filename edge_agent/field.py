# A field device's parts: the folder pool, the folder oracle, the label page, and the work between rounds.
from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_agent.device_data import DeviceData
from edge_agent.fashion_mnist import normalise
from edge_agent.folder_oracle import FolderOracle, QueryBook
from edge_agent.folder_pool import MODEL_INPUT, InputSpec, open_folder_data
from edge_agent.label_ui import LabelServer, parse_listen_address
from edge_agent.mc_dropout import TorchMCDropout
from edge_agent.models import build_model, set_weights
from edge_agent.profile import DeviceProfile
from edge_agent.sampling import entropy_scores
from edge_agent.stream import BudgetSettings, BudgetState, decide, default_burst, start_state
from edge_agent.tensors import Weights

log = logging.getLogger(__name__)

DEFAULT_POOL_CAP = 20000
STREAM_STATE_KEY = "stream"
STREAM_PASSES = 10


class StreamAcquirer:
    """Scores each new pool item once (MC-dropout entropy, newest global model) and asks for it within the budget.

    The bucket, recent scores and how far the pool has been scored persist in the agent's state before the
    queries are written, so a crash can only under-spend the budget, never exceed it.
    """

    def __init__(
        self,
        data: DeviceData,
        oracle: FolderOracle,
        budget: BudgetSettings,
        model_name: str = "paper-cnn",
        passes: int = STREAM_PASSES,
        inference_batch: int = 256,
    ) -> None:
        self.data = data
        self.oracle = oracle
        self.budget = budget
        self.passes = passes
        self.inference_batch = inference_batch
        self._model = build_model(model_name)
        self._loaded: Weights | None = None

    def score_new(self, weights: Weights, round_id: int) -> None:
        """Scores the items that arrived since the last call and asks for those the controller picks."""
        saved = self.data.get_state(STREAM_STATE_KEY) or {}
        first, end = int(saved.get("scored_upto", 0)), self.data.num_samples
        if first >= end:
            return
        if weights is not self._loaded:
            set_weights(self._model, weights)
            self._loaded = weights
        new = np.arange(first, end)
        probabilities = TorchMCDropout(self._model, self.inference_batch).probabilities(
            normalise(self.data.images(new)), self.passes, seed=first
        )
        scores = entropy_scores(probabilities)
        now = time.time()
        state = BudgetState.from_json(saved["budget"]) if "budget" in saved else start_state(self.budget, now)
        asked = []
        for index, score in zip(new.tolist(), scores.tolist()):
            query, state = decide(state, score, now, self.budget)
            if query:
                asked.append(index)
        self.data.set_state(STREAM_STATE_KEY, {"scored_upto": end, "budget": state.to_json()})
        self.oracle.start_round(round_id)
        self.oracle.ask(np.array(asked, dtype=np.int64))
        log.info(
            "stream scored new=%d asked=%d tokens=%.2f max_entropy=%.3f",
            len(new),
            len(asked),
            state.tokens,
            float(scores.max()),
        )


class FieldWork:
    """Rescans the pool folder every scan_interval seconds and, with a stream, scores what arrived."""

    def __init__(self, data: DeviceData, scan_interval: float, stream: StreamAcquirer | None = None) -> None:
        self.data = data
        self.scan_interval = scan_interval
        self.stream = stream
        self._next_scan = 0.0

    def tick(self, weights: Weights | None, round_id: int) -> None:
        """Scans the folder when the interval has passed; scores new items once a global model has arrived."""
        if time.monotonic() < self._next_scan:
            return
        self._next_scan = time.monotonic() + self.scan_interval
        self.data.refresh()
        if self.stream is not None and weights is not None:
            self.stream.score_new(weights, round_id)


@dataclass
class FieldParts:
    """What a field agent runs with: its data, oracle, between-round work and (optional) label page."""

    data: DeviceData
    oracle: FolderOracle
    work: FieldWork
    label_server: LabelServer | None


def _input_spec(manifest_path: Path | None) -> InputSpec:
    """The model's input from a bundle manifest, or the paper CNN's."""
    if manifest_path is None:
        return MODEL_INPUT
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{manifest_path}: unreadable manifest ({exc})") from exc
    return InputSpec.from_manifest(manifest, str(manifest_path))


def open_field(
    args: argparse.Namespace, state_dir: Path, model_name: str, inference_batch: int, profile: DeviceProfile | None
) -> FieldParts:
    """Opens the folder pool and the folder oracle for `edge-agent run --pool-dir`; starts the label page if asked."""
    pool_cap = profile.pool_size_cap if profile else DEFAULT_POOL_CAP
    oracle_dir = args.oracle_dir or state_dir / "labelling"
    listen = parse_listen_address(args.label_ui) if args.label_ui else None
    budget = None
    if args.stream:
        budget = BudgetSettings(args.labels_per_hour, args.label_burst or default_burst(args.labels_per_hour))
    data = open_folder_data(
        state_dir, args.pool_dir, pool_cap, _input_spec(args.manifest), args.settle_seconds, skip_dirs=(oracle_dir,)
    )
    book = QueryBook(oracle_dir)
    oracle = FolderOracle(book, data, args.answer_wait)
    stream = StreamAcquirer(data, oracle, budget, model_name, inference_batch=inference_batch) if budget else None
    server = LabelServer(book, *listen).start() if listen else None
    return FieldParts(data, oracle, FieldWork(data, args.scan_interval, stream), server)
