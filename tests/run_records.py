# Test helper: a real run store holding two committed rounds of three devices, a suspect and a rejection.
from __future__ import annotations

import math
from pathlib import Path

from coordinator.storage.store import DeviceRoundRecord, RoundRecord, RunStore

DEVICES = ("dev-00", "dev-01", "dev-02")
LAYERS = ("conv1.weight", "fc2.bias")
LOCAL_ACCURACY = (0.4, 0.41, 0.42)
STALE = "stale round: update is for round 1, the current round is 2"


def fill_store(run_dir: Path) -> None:
    """Two committed rounds of three devices; in round 2 dev-02 is a suspect with an all-zero (inf) layer and an
    intruder's stale update was rejected."""
    with RunStore(run_dir) as store:
        store.set_config(
            {
                "run_id": "run-x",
                "settings": {"fleet": "plant", "strategy": "avefl", "policy": {"rounds": 5}, "recipe": {"epochs": 1}},
            }
        )
        for round_id in (1, 2):
            suspects = {"dev-02": list(LAYERS)} if round_id == 2 else {}
            store.commit_round(
                RoundRecord(
                    round_id,
                    100.0 * round_id,
                    100.0 * round_id + 12.5,
                    "ab" * 32,
                    0.5 + 0.1 * round_id,
                    100 + 60 * round_id,
                    3,
                    int(round_id == 2),
                    {"suspects": suspects, "aggregation_seconds": 0.25},
                    {
                        "quorum": 3,
                        "stragglers": ["dev-09"] if round_id == 2 else [],
                        "class_accuracy": [0.5] * 10,
                        "device_class_accuracy": {d: [0.1 * i] * 10 for i, d in enumerate(DEVICES)},
                    },
                ),
                [
                    DeviceRoundRecord(
                        round_id,
                        device,
                        True,
                        "",
                        50 + 20 * round_id,
                        [round_id * (i + 1)] * 10,
                        LOCAL_ACCURACY[i],
                        {
                            LAYERS[0]: 0.01 * (i + 1),
                            LAYERS[1]: math.inf if (device, round_id) == ("dev-02", 2) else 0.02,
                        },
                        1000 + i,
                        100.0 * round_id + 5 + i,
                        20 * round_id,
                    )
                    for i, device in enumerate(DEVICES)
                ],
            )
        store.record_rejection(2, "intruder", STALE, 77)
