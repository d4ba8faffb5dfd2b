# The dashboard's JSON API, /metrics and token rule over plain HTTP, against a real SQLite store and live state.
from __future__ import annotations

import json
import re
import socket
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from run_records import DEVICES, LAYERS, LOCAL_ACCURACY, STALE, fill_store

from coordinator.dashboard.live import LiveState
from coordinator.dashboard.server import Dashboard, ListenAddress, dashboard_token, parse_listen_address
from coordinator.intake.observer import RoundResult
from coordinator.intake.validation import Rejection
from coordinator.storage.store import RoundRecord, RunStore
from protocol import messages


def get(url: str, token: str | None = None) -> tuple[int, str, str]:
    """(status, content type, body) of a GET, HTTP errors included."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read().decode()


def get_json(url: str, token: str | None = None) -> tuple[int, dict]:
    """(status, decoded body) of a JSON API GET; the body must be strict JSON (no NaN or Infinity)."""
    status, content_type, body = get(url, token)
    assert content_type == "application/json"
    return status, json.loads(body, parse_constant=lambda name: pytest.fail(f"non-strict JSON constant {name}"))


def feed_live(live: LiveState) -> None:
    """dev-00 online and dev-02 training with profiles; dev-01's last will said offline; acks and round 2 closed."""
    live.device_status("dev-00", messages.Status("dev-00", "online", 1.0, 2, 90, "simulated"))
    live.device_status("dev-01", messages.Status("dev-01", "offline", 0.0, profile="raspberry-pi-4"))
    live.device_status("dev-02", messages.Status("dev-02", "training", 1.0, 2, 70, "jetson-nano", peak_rss_mb=451.1))
    live.round_opened(2, needed=3)
    for size, device in enumerate(DEVICES, start=1000):
        live.update_answered(device, 2, size, None)
    live.update_answered("intruder", 2, 77, Rejection(messages.RejectionKind.STALE_ROUND, STALE))
    undecodable = "undecodable: undecodable msgpack (ExtraData)"
    live.update_answered("intruder", 2, 5, Rejection(messages.RejectionKind.UNDECODABLE, undecodable))
    live.round_closed(RoundResult(2, 0.7, {}, 220, {}, 12.5, {}, {"aggregation_seconds": 0.25}))


@pytest.fixture
def served(tmp_path: Path):
    """A loopback dashboard over a filled store and a fed live state: yields its base URL."""
    fill_store(tmp_path / "run")
    live = LiveState(total_rounds=5)
    feed_live(live)
    with Dashboard(ListenAddress("127.0.0.1", 0), tmp_path / "run", live, None) as dashboard:
        yield dashboard.url


def test_run_and_devices_merge_store_and_live_state(served: str) -> None:
    status, run = get_json(served + "api/run")
    assert status == 200
    assert (run["run_id"], run["fleet"], run["strategy"], run["total_rounds"]) == ("run-x", "plant", "avefl", 5)
    assert (run["round"], run["rounds_completed"], run["devices_online"], run["phase"]) == (2, 2, 2, "closed")
    devices = {d["device_id"]: d for d in get_json(served + "api/devices")[1]["devices"]}
    assert sorted(devices) == [*DEVICES, "intruder"]
    assert [devices[d]["state"] for d in DEVICES] == ["online", "offline", "training"]
    assert [devices[d]["online"] for d in DEVICES] == [True, False, True]
    assert [devices[d]["profile"] for d in DEVICES] == ["simulated", "raspberry-pi-4", "jetson-nano"]
    assert [devices[d]["peak_rss_mb"] for d in DEVICES] == [None, None, 451.1]
    assert [devices[d]["rounds_joined"] for d in DEVICES] == [2, 2, 2]
    assert devices["dev-00"]["labelled"] == 90 and devices["dev-02"]["labelled"] == 70
    assert devices["dev-01"]["labelled"] == 90  # no status count: its latest accepted update's sample count
    assert devices["dev-02"]["class_counts"] == [6] * 10
    assert devices["dev-01"]["last_update"]["size"] == 1001 and devices["dev-01"]["last_update"]["accepted"]
    intruder = devices["intruder"]
    assert intruder["rounds_joined"] == 0 and not intruder["last_update"]["accepted"]
    assert intruder["last_update"]["reason"].startswith("undecodable")


def test_rounds_divergence_and_class_accuracy(served: str) -> None:
    rounds = get_json(served + "api/rounds")[1]["rounds"]
    assert [r["round"] for r in rounds] == [1, 2]
    second = rounds[1]
    assert second["seconds"] == 12.5 and second["quorum"] == 3 and second["stragglers"] == ["dev-09"]
    assert second["rejections"] == [{"device_id": "intruder", "reason": STALE}]
    assert second["suspects"] == {"dev-02": list(LAYERS)}
    assert second["device_accuracy"] == dict(zip(DEVICES, LOCAL_ACCURACY))
    status, divergence = get_json(served + "api/rounds/2/divergence")
    assert status == 200
    assert divergence["devices"] == list(DEVICES) and divergence["layers"] == sorted(LAYERS)
    assert divergence["values"] == [[0.01, 0.02], [0.02, 0.02], [0.03, None]]  # inf is sent as null
    assert divergence["suspects"] == {"dev-02": list(LAYERS)}
    classes = get_json(served + "api/rounds/1/class-accuracy")[1]
    assert classes["aggregate"] == [0.5] * 10 and classes["devices"]["dev-02"] == [0.2] * 10


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("api/rounds/7/divergence", "round 7 is not committed"),
        ("api/rounds/x/divergence", "no such path"),
        ("api/nothing", "no such path"),
    ],
)
def test_unknown_paths_and_rounds_are_json_404s(served: str, path: str, message: str) -> None:
    status, body = get_json(served + path)
    assert status == 404 and message in body["error"]


def metric_lines(text: str) -> dict[str, float]:
    """Sample name (with labels) -> value, checking every family has HELP and TYPE before its samples."""
    samples, declared = {}, set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            declared.add(line.split()[2])
        elif not line.startswith("# HELP "):
            name, value = line.rsplit(" ", 1)
            assert any(name.split("{")[0].startswith(family) for family in declared), line
            samples[name] = float(value)
    return samples


def test_metrics_in_prometheus_text_format(served: str) -> None:
    status, content_type, body = get(served + "metrics")
    assert status == 200 and content_type.startswith("text/plain; version=0.0.4")
    samples = metric_lines(body)
    assert samples == {
        "fl_rounds_completed_total": 1,
        "fl_current_round": 2,
        "fl_serving_version": 0,
        "fl_updates_accepted_total": 3,
        'fl_updates_rejected_total{reason="stale_round"}': 1,
        'fl_updates_rejected_total{reason="undecodable"}': 1,
        "fl_devices_online": 2,
        "fl_aggregation_seconds_sum": 0.25,
        "fl_aggregation_seconds_count": 1,
        "fl_update_bytes_received_total": 1000 + 1001 + 1002 + 77 + 5,
        'fl_part_up{part="dashboard"}': 1,
        'fl_part_restarts_total{part="dashboard"}': 0,
        'fl_http_open_connections{server="dashboard"}': 1,
        'fl_http_connections_refused_total{server="dashboard"}': 0,
        'fl_http_requests_timed_out_total{server="dashboard"}': 0,
    }
    for family in ("fl_rounds_completed_total", "fl_updates_rejected_total", "fl_aggregation_seconds"):
        assert f"# HELP {family} " in body and f"# TYPE {family} " in body


def test_api_follows_the_store_as_rounds_commit(tmp_path: Path) -> None:
    fill_store(tmp_path / "run")
    with Dashboard(ListenAddress("127.0.0.1", 0), tmp_path / "run", None, None) as dashboard:
        assert [r["round"] for r in get_json(dashboard.url + "api/rounds")[1]["rounds"]] == [1, 2]
        with RunStore(tmp_path / "run") as writer:
            writer.commit_round(RoundRecord(3, 300.0, 305.0, "cd" * 32, 0.8, 400, 0, 0, {}, {}), [])
            assert [r["round"] for r in get_json(dashboard.url + "api/rounds")[1]["rounds"]] == [1, 2, 3]
            writer.record_rejection(3, "dev-01", "too large: 9 bytes exceeds the limit of 8", 9)
            devices = {d["device_id"]: d for d in get_json(dashboard.url + "api/devices")[1]["devices"]}
        assert devices["dev-01"]["last_update"]["reason"].startswith("too large")
        assert get_json(dashboard.url + "api/run")[1]["phase"] == "stored"  # no live state: from the store alone


def test_api_answers_before_the_store_exists(tmp_path: Path) -> None:
    with Dashboard(ListenAddress("127.0.0.1", 0), tmp_path / "not-yet", LiveState(3), None) as dashboard:
        assert get_json(dashboard.url + "api/rounds") == (200, {"rounds": []})
        assert get_json(dashboard.url + "api/devices") == (200, {"devices": [], "labelling": None})
        run = get_json(dashboard.url + "api/run")[1]
        assert (run["phase"], run["round"], run["total_rounds"]) == ("starting", 0, 3)
    assert not (tmp_path / "not-yet").exists()


def test_token_required_beyond_loopback(tmp_path: Path) -> None:
    fill_store(tmp_path / "run")
    address = ListenAddress("0.0.0.0", 0)
    token = dashboard_token(address, None, tmp_path / "run")
    token_file = tmp_path / "run" / "dashboard-token"
    assert token and token_file.read_text() == token and stat.S_IMODE(token_file.stat().st_mode) == 0o600
    with Dashboard(address, tmp_path / "run", LiveState(5), token) as dashboard:
        url = dashboard.url.replace("0.0.0.0", "127.0.0.1")
        for path in ("api/run", "api/devices", "api/rounds/1/divergence", "metrics"):
            assert get(url + path)[0] == 401
            assert get(url + path, token="wrong-" + token)[0] == 401
            assert get(url + path, token=token)[0] == 200
        assert get(url)[0] == 200 and "dashboard.js" in get(url)[2]  # the page holds no data; its API does


def test_token_rules() -> None:
    loopback, everywhere = ListenAddress("127.0.0.1", 1), ListenAddress("0.0.0.0", 1)
    assert dashboard_token(loopback, None, Path("/nonexistent")) is None
    assert dashboard_token(everywhere, "a-token-of-twenty-chars", Path("/nonexistent")) == "a-token-of-twenty-chars"
    with pytest.raises(ValueError, match="at least 16 characters"):
        dashboard_token(loopback, "short", Path("/nonexistent"))


@pytest.mark.parametrize(
    ("text", "host", "port", "loopback"),
    [
        ("8080", "127.0.0.1", 8080, True),
        ("0.0.0.0:9000", "0.0.0.0", 9000, False),
        ("localhost:0", "localhost", 0, True),
        ("[::1]:8080", "::1", 8080, True),
        ("10.1.2.3:80", "10.1.2.3", 80, False),
    ],
)
def test_listen_addresses(text: str, host: str, port: int, loopback: bool) -> None:
    address = parse_listen_address(text)
    assert (address.host, address.port, address.loopback) == (host, port, loopback)


@pytest.mark.parametrize("text", ["", "http://x:80", "host:", "99999", "a b:80"])
def test_bad_listen_addresses(text: str) -> None:
    with pytest.raises(ValueError, match=r"--dashboard must look like \[HOST:\]PORT"):
        parse_listen_address(text)


def test_port_in_use_is_one_clear_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ValueError, match="cannot listen"):
            Dashboard(ListenAddress("127.0.0.1", taken.getsockname()[1]), tmp_path, None, None)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--dashboard", "nowhere:port"], "--dashboard must look like"),
        (["--dashboard-token", "0123456789abcdef"], "--dashboard-token needs --dashboard"),
    ],
)
def test_bad_dashboard_options_give_one_line(tmp_path: Path, arguments: list[str], message: str) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "simulate",
            "--devices",
            "2",
            "--rounds",
            "1",
            "--run-dir",
            str(tmp_path / "run"),
            *arguments,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run" / "devices").exists()


def test_a_rejection_keeps_its_kind_and_caps_its_reason() -> None:
    rejection = Rejection(messages.RejectionKind.UNDECODABLE, "undecodable: " + "x" * 5000)
    assert rejection.kind == "undecodable" and len(rejection.reason) == 300
    assert rejection.reason.startswith("undecodable: xxx") and rejection.reason.endswith("[truncated]")


def test_read_only_store_cannot_write_or_create(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no run database"):
        RunStore(tmp_path / "missing", read_only=True)
    assert not (tmp_path / "missing").exists()
    fill_store(tmp_path / "run")
    with RunStore(tmp_path / "run", read_only=True) as reader:
        assert [r.round_id for r in reader.rounds()] == [1, 2]
        with pytest.raises(Exception, match="readonly"):
            reader.record_rejection(3, "dev-00", "x", 1)


def test_a_generated_token_can_be_given_back_on_a_command_line(tmp_path: Path) -> None:
    """A token generated off loopback is what a person passes to `labelling serve --dashboard-token TOKEN` or curl:
    it must never start with '-', which argparse takes for a flag (a base64 token did so once in 64)."""
    tokens = [dashboard_token(ListenAddress("0.0.0.0", 0), None, tmp_path) for _ in range(300)]
    assert all(token is not None and re.fullmatch(r"[0-9a-f]{48}", token) for token in tokens)
