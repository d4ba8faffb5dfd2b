# Group commit of the spool: one fsync per batch, acks only after it, torn tails ignored, nothing acked lost.
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from fleet import WAIT

from coordinator.intake.observer import RoundObserver
from coordinator.intake.update_intake import RoundCollector, UpdateIntake
from coordinator.intake.validation import Expectation
from coordinator.storage.spool import Spool
from coordinator.storage.store import RunStore
from protocol import messages, topics, wire
from protocol.tensors import spec_of, weights_hash

BASE = {"w": np.zeros((3, 4), dtype=np.float32), "b": np.zeros(4, dtype=np.float32)}


def update_payload(device_id: str, value: float) -> bytes:
    """A valid round-1 update of BASE from device_id, every weight `value`."""
    tensors = {name: np.full_like(array, value) for name, array in BASE.items()}
    update = messages.Update(device_id, 1, f"u-{device_id}", weights_hash(BASE), 10, [1] * 10, 0, {}, tensors)
    return wire.encode(update)


def test_a_torn_segment_tail_is_ignored_and_a_restart_appends_a_new_segment(tmp_path: Path) -> None:
    first = Spool(tmp_path)
    for device in ("dev-a", "dev-b", "dev-c"):
        first.stage(1, device, device.encode() * 100)
    first.commit()
    first.add(1, "dev-d", b"d" * 50)
    first.close()
    segment = tmp_path / "round_0001" / "segment_000001.log"
    with segment.open("ab") as handle:  # a batch the crash cut short: its header and half of its payload
        handle.write(b"SPL1" + (5).to_bytes(2, "big") + (1000).to_bytes(4, "big") + bytes(4) + b"dev-e" + b"e" * 400)
    second = Spool(tmp_path)
    assert second.payloads(1) == {**{d: d.encode() * 100 for d in ("dev-a", "dev-b", "dev-c")}, "dev-d": b"d" * 50}
    second.add(1, "dev-e", b"again")
    assert sorted(path.name for path in segment.parent.iterdir()) == ["segment_000001.log", "segment_000002.log"]
    assert Spool(tmp_path).payload(1, "dev-e") == b"again"
    assert [device for device, _ in Spool(tmp_path).items(1)] == ["dev-a", "dev-b", "dev-c", "dev-d", "dev-e"]


WRITER = """
import sys
from pathlib import Path
from coordinator.storage.spool import Spool
spool = Spool(Path(sys.argv[1]))
for batch in range(10_000):
    for index in range(8):
        spool.stage(1, f"dev-{batch:05d}-{index}", bytes([index]) * 20_000)
    spool.commit()
    print(batch, flush=True)
"""


def test_every_batch_acknowledged_before_a_sigkill_is_read_back_whole(tmp_path: Path) -> None:
    """A real process group-commits 8 updates a batch and says so after each commit (where the coordinator acks);
    SIGKILL mid-stream: every batch it had reported is there, byte for byte, and nothing torn is read (a record of
    the unreported batch may be whole: the broker redelivers its message, which is then acked idempotently)."""
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout is not None
    reported = -1
    while reported < 30:
        reported = int(writer.stdout.readline())
    writer.send_signal(signal.SIGKILL)
    writer.wait(WAIT)
    spooled = Spool(tmp_path).payloads(1)
    for batch in range(reported + 1):
        for index in range(8):
            assert spooled[f"dev-{batch:05d}-{index}"] == bytes([index]) * 20_000
    for device, payload in spooled.items():  # records of the batch cut short (never acked) are whole or left out
        assert payload == bytes([int(device[-1])]) * 20_000


def test_a_batchs_acks_are_published_only_after_its_fsync(tmp_path: Path, broker, sessions, monkeypatch) -> None:
    events: list[str] = []
    sync = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (events.append("fsync"), sync(fd))[1])
    listener = sessions(broker.address, "listener")
    listener.subscribe(topics.ACK.filter(fleet="gc"))
    session = sessions(broker.address, "coordinator-gc")
    publish = session.publish
    monkeypatch.setattr(session, "publish", lambda *args, **kw: (events.append("publish"), publish(*args, **kw))[1])
    store = RunStore(tmp_path / "run")
    intake = UpdateIntake("gc", session, store, RoundObserver())
    expectation = Expectation(1, weights_hash(BASE), spec_of(BASE), 10, 10**6, base=BASE)
    collector = RoundCollector(expectation)
    for device in ("dev-a", "dev-b"):
        intake.on_update(device, update_payload(device, 0.5), collector, [])
    intake.on_update("dev-c", b"not msgpack", collector, [])
    assert events == [] and Spool(tmp_path / "run" / "spool").payloads(1) == {}
    intake.commit()
    assert events == ["fsync", "publish", "publish", "publish"]
    assert set(Spool(tmp_path / "run" / "spool").payloads(1)) == {"dev-a", "dev-b"}
    acks = {}
    deadline = time.monotonic() + WAIT
    while len(acks) < 3 and time.monotonic() < deadline:
        message = listener.next_message(timeout=0.2)
        if message is not None:
            ack = wire.decode(message.payload, messages.Ack)
            acks[ack.device_id] = ack.accepted
    assert acks == {"dev-a": True, "dev-b": True, "dev-c": False}
    store.close()
