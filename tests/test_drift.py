# Drift: the one test both sides apply, and a device's watch that turns its acquisitions to the new images.
from __future__ import annotations

import hashlib
import sqlite3
import threading
from pathlib import Path

import numpy as np
import pytest

from bench.camera_drift import drift_when_committed
from bench.camera_fleet import POOL_DIR, FleetSettings, PeopleAtThePage, build_fleet, device_dir
from bench.camera_path import CameraSite, CentralLabelling, run_camera_site
from bench.camera_scenes import DEFAULT_CLASSES, SceneSet, pick_items, render_set
from coordinator.fleet.broker import free_loopback_port
from edge_agent.data.device_data import DeviceData
from edge_agent.data.image_arrays import ImageDataset
from edge_agent.learning.drift import DRIFT_MIN_BASELINE, Seen, drift_reason, mix_moved, uncertain_jump
from edge_agent.learning.predict import Verdicts
from edge_agent.loop.drift_watch import WATCH_KEY, DriftWatch, FocusRule, Watch, focus_of

CLASSES = 5


def said(classes: np.ndarray, uncertain: np.ndarray) -> Verdicts:
    """Verdicts with these predicted classes, uncertain where asked (0.9, else 0.1)."""
    return Verdicts(classes, np.full(len(classes), 0.5), np.where(uncertain, 0.9, 0.1))


def test_the_uncertain_share_must_jump_on_enough_images_each_side() -> None:
    assert uncertain_jump(13, 40, 10, 100)  # 0.325 against 0.10
    assert not uncertain_jump(11, 40, 10, 100)  # 0.275: a jump of 0.175
    assert not uncertain_jump(19, 19, 0, 100)  # too few recent images to trust
    assert not uncertain_jump(20, 20, 0, DRIFT_MIN_BASELINE - 1)  # too few older ones


def test_a_moved_class_mix_is_drift_and_the_same_mix_drawn_again_is_not() -> None:
    rng = np.random.default_rng(0)
    shares = np.full(CLASSES, 1 / CLASSES)
    false_alarms = sum(mix_moved(rng.multinomial(60, shares), rng.multinomial(200, shares)) for _ in range(300))
    assert false_alarms <= 3  # the test's level is 0.001
    moved = np.array([0.4, 0.4, 0.07, 0.07, 0.06])
    assert mix_moved(rng.multinomial(60, moved), rng.multinomial(200, shares))
    assert not mix_moved(np.array([19, 0, 0, 0, 0]), np.full(CLASSES, 40))  # 19 recent: below the minimum


def test_the_reason_names_the_drift_and_stays_short() -> None:
    even = Seen(200, 20, np.full(CLASSES, 40))
    assert drift_reason(Seen(60, 6, np.full(CLASSES, 12)), even) is None
    dark = drift_reason(Seen(60, 30, np.full(CLASSES, 12)), even)
    assert dark == "uncertain share 0.50 on 60 new images against 0.10 on 200 older"
    mix = drift_reason(Seen(60, 6, np.array([30, 24, 2, 2, 2])), even)
    assert mix is not None and mix.startswith("predicted class mix moved on 60 new images") and "class 0: 0.50" in mix
    huge = drift_reason(Seen(10**9, 10**9, np.full(CLASSES, 2 * 10**8)), Seen(10**9, 0, np.full(CLASSES, 2 * 10**8)))
    assert huge is not None and len(huge) < 120


def drifted_pool(old: int = 80, new: int = 60) -> tuple[np.ndarray, Verdicts]:
    """A pool of `old` images seen before and `new` since, the new ones mostly of classes 0 and 1."""
    rng = np.random.default_rng(1)
    classes = np.concatenate([np.arange(old) % CLASSES, rng.choice([0, 1], size=new)])
    return np.arange(old + new), said(classes, np.zeros(old + new, dtype=bool))


def never() -> Verdicts:
    """Verdicts that must not be asked for."""
    raise AssertionError("the watch scored the pool where it had nothing to compare")


def test_the_watch_turns_to_the_new_images_for_its_acquisitions_then_back() -> None:
    pool, verdicts = drifted_pool()
    rule = FocusRule(acquisitions=2, budget=10)
    first, focus, reason = focus_of(Watch(), pool[:80], 80, never, CLASSES, rule)
    assert (first, focus, reason) == (Watch(80), None, None)  # nothing to compare before the first acquisition
    second, focus, reason = focus_of(first, pool, 140, lambda: verdicts, CLASSES, rule)
    assert reason is not None and reason.startswith("predicted class mix moved on 60 new images against 80 older")
    assert focus is not None and np.array_equal(pool[focus], np.arange(80, 140))
    assert second == Watch(140, since=80, left=1)
    third, focus, _ = focus_of(second, pool[5:], 140, never, CLASSES, rule)  # labelled some: still > budget new
    assert focus is not None and np.array_equal(pool[5:][focus], np.arange(80, 140)) and third == Watch(140, 80, 0)
    fourth, focus, reason = focus_of(third, pool[5:], 140, never, CLASSES, rule)  # no arrivals: nothing to compare
    assert (fourth, focus, reason) == (Watch(140), None, None)


def test_no_drift_or_too_few_new_images_leaves_the_whole_pool() -> None:
    pool, verdicts = drifted_pool()
    steady = said(np.arange(140) % CLASSES, np.zeros(140, dtype=bool))
    after, focus, reason = focus_of(Watch(80), pool, 140, lambda: steady, CLASSES, FocusRule(2, 10))
    assert (after, focus, reason) == (Watch(140), None, None)
    after, focus, reason = focus_of(Watch(80), pool, 140, lambda: verdicts, CLASSES, FocusRule(2, 60))
    assert reason is not None and focus is None and after == Watch(140)  # 60 new images cannot fill 60 and choose
    left, focus, _ = focus_of(Watch(140, 80, 1), pool[:90], 140, never, CLASSES, FocusRule(2, 10))
    assert focus is None and left == Watch(140)  # the drifted images ran out: back to the whole pool


def device(tmp_path: Path) -> DeviceData:
    """A real device store of 140 images."""
    return DeviceData.create(tmp_path / "state", np.zeros((140, 28, 28), dtype=np.uint8))


def test_the_watch_lives_in_the_journal_and_stays_off_at_zero(tmp_path: Path) -> None:
    data = device(tmp_path)
    pool, verdicts = drifted_pool()
    watch = DriftWatch(data, "cam-0")
    assert watch.focus(pool, never, FocusRule(0, 10)) is None and data.get_state(WATCH_KEY) is None
    data.set_state(WATCH_KEY, {"seen_upto": 80, "since": 0, "left": 0})
    focus = DriftWatch(DeviceData.open(tmp_path / "state"), "cam-0").focus(pool, lambda: verdicts, FocusRule(3, 10))
    assert focus is not None and len(focus) == 60
    assert DeviceData.open(tmp_path / "state").get_state(WATCH_KEY) == {"seen_upto": 140, "since": 80, "left": 2}


@pytest.mark.parametrize("kept", ["not a watch", {"seen_upto": "80", "since": 0, "left": 0}, {"seen_upto": True}])
def test_a_damaged_watch_starts_afresh(tmp_path: Path, kept: object) -> None:
    data = device(tmp_path)
    data.set_state(WATCH_KEY, kept)
    pool, _ = drifted_pool()
    assert DriftWatch(data, "cam-0").focus(pool, never, FocusRule(2, 10)) is None
    assert data.get_state(WATCH_KEY) == {"seen_upto": 140, "since": 0, "left": 0}


def queried_rounds(state_dir: Path) -> dict[int, list[str]]:
    """Round -> the sha256 of each image the device asked about in it (from its query store)."""
    (store,) = state_dir.rglob("answers.sqlite")
    with sqlite3.connect(store) as database:
        rows = database.execute("SELECT round_id, sha256 FROM queries").fetchall()
    asked: dict[int, list[str]] = {}
    for round_id, digest in rows:
        asked.setdefault(round_id, []).append(digest)
    return asked


def one_class_scenes(fashion: ImageDataset, size: int, stream: int, count: int = 80) -> SceneSet:
    """`count` new scenes, all of the first class (boots): a camera that now sees one thing."""
    indices, _ = pick_items(fashion.train_labels, DEFAULT_CLASSES[:1], count, np.random.default_rng(stream))
    return render_set(fashion.train_images[indices], np.zeros(count, dtype=np.int64), size, 3, stream)


@pytest.mark.integration
def test_a_fleet_whose_cameras_drift_asks_about_the_new_images(tmp_path: Path, fashion: ImageDataset) -> None:
    """Real processes: the guide's coordinator with --drift-acquisitions 2 and two field agents labelling centrally
    (random sampling); once round 1 commits, each camera sees one class only (new scenes in its folder). The
    acquisition that first holds them logs the drift, and every round that asks about new scenes asks about nothing
    else."""
    fleet_dir, devices, rounds = tmp_path / "fleet", 2, 3
    settings = FleetSettings(devices, DEFAULT_CLASSES, 20, 10, seed=3, server_per_class=10)
    build_fleet(fleet_dir, settings, fashion)
    pools = [
        (device_dir(fleet_dir, n) / POOL_DIR, one_class_scenes(fashion, settings.size, 100 + n)) for n in range(devices)
    ]
    flags = ("--drift-acquisitions", "2", "--sampler", "random")
    central = CentralLabelling(free_loopback_port())
    site = CameraSite(fleet_dir, tmp_path, free_loopback_port(), devices, rounds, 5, flags, central=central)
    people = site.people(tuple(scene.name for scene in settings.classes))
    assert isinstance(people, PeopleAtThePage)
    for _, scenes in pools:
        people.key.update((hashlib.sha256(jpeg).hexdigest(), 0) for jpeg in scenes.jpegs)
    stop = threading.Event()
    drifter = threading.Thread(target=drift_when_committed, args=(site.run_dir, 1, pools, stop))
    drifter.start()
    try:
        codes = run_camera_site(site, timeout=300, people=people)
    finally:
        stop.set()
        drifter.join()
    assert codes == [0] * (devices + 1), (tmp_path / "coordinator.log").read_text()[-3000:]
    for number, (_, scenes) in enumerate(pools):
        new = {hashlib.sha256(jpeg).hexdigest() for jpeg in scenes.jpegs}
        log = (tmp_path / f"cam-{number}.log").read_text()
        assert f"drift device=cam-{number} predicted class mix moved on " in log, log[-2000:]
        asked = queried_rounds(site.state_dir(number))
        assert asked[1] and not set(asked[1]) & new  # before the drift: the old scenes only
        after = [round_id for round_id in range(2, rounds + 1) if set(asked.get(round_id, ())) & new]
        assert after, f"no round asked about the new scenes: {asked}"
        assert all(set(asked[round_id]) <= new for round_id in after), asked
