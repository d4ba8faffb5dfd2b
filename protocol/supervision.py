# One supervision rule for every long-lived part: a failure is logged with its traceback, the part restarts after a
# back-off and shows its health, and a message that fails its handler k times is set aside instead of redelivered.
from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from protocol.files import atomic_write_bytes

log = logging.getLogger(__name__)
R = TypeVar("R")

FIRST_BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 30.0
ATTEMPTS = 3  # a message's handler runs at most this often before the message is set aside
MAX_SENDERS = 100  # senders counted by name; the rest under OTHER_SENDERS, so /metrics stays bounded
OTHER_SENDERS = "(other)"
KEPT_MESSAGES = 20  # set-aside messages kept for inspection, newest first
ERROR_CHARACTERS = 200
LEDGER_KEYS = 64  # messages whose failures a ledger remembers
SET_ASIDE = "set-aside"  # the folder (in a run or state directory) of set-aside messages and the ledger
LEDGER = "ledger.json"


@dataclass
class PartHealth:
    """One part's health as /metrics and the dashboard show it: up or restarting, how often it restarted, and its
    last failure (type and message, cut short)."""

    name: str
    up: bool = True
    restarts: int = 0
    last_error: str = ""
    failed_at: float = 0.0


@dataclass
class Health:
    """The health of one process's supervised parts and the messages they set aside, by sender (bounded): what the
    process shows of itself. Written by the parts' threads, read by the page's."""

    parts: dict[str, PartHealth] = field(default_factory=dict)
    set_aside: Counter[tuple[str, str]] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def running(self, name: str) -> None:
        """The part runs (again)."""
        with self._lock:
            self.parts.setdefault(name, PartHealth(name)).up = True

    def failed(self, name: str, error: BaseException) -> int:
        """The part failed and will restart; returns how many times it has now restarted."""
        with self._lock:
            part = self.parts.setdefault(name, PartHealth(name))
            part.up, part.restarts, part.failed_at = False, part.restarts + 1, time.time()
            part.last_error = described(error)
            return part.restarts

    def stopped(self, name: str) -> None:
        """The part ended on purpose (its process stops it)."""
        with self._lock:
            self.parts.setdefault(name, PartHealth(name)).up = False

    def note_set_aside(self, part: str, sender: str) -> None:
        """Counts one message set aside, by its sender (named while fewer than MAX_SENDERS are)."""
        with self._lock:
            self.set_aside[(part, bounded_name({who for _, who in self.set_aside}, sender))] += 1

    def snapshot(self) -> tuple[list[PartHealth], dict[tuple[str, str], int]]:
        """Copies of the parts' health and the set-aside counts, for a page."""
        with self._lock:
            parts = [PartHealth(p.name, p.up, p.restarts, p.last_error, p.failed_at) for p in self.parts.values()]
            return parts, dict(self.set_aside)


def bounded_name(named: set[str], sender: str) -> str:
    """The name a count by sender keeps `sender` under: its own while it is named already or fewer than
    MAX_SENDERS are, else OTHER_SENDERS (so a page of counts stays bounded however many ids a sender invents)."""
    return sender if sender in named or len(named) < MAX_SENDERS else OTHER_SENDERS


def described(error: BaseException) -> str:
    """An exception as one bounded line: its type and the start of its message."""
    return f"{type(error).__name__}: {str(error)[:ERROR_CHARACTERS]}"


class SupervisedThread:
    """A part's loop on a daemon thread under the rule: `loop(stop)` runs until `stop` is set; an exception escaping
    it is logged with its traceback and shown in `health`, and the loop starts again after a back-off (1 s,
    doubling to 30 s; reset once the loop has run a minute without failing)."""

    def __init__(self, name: str, loop: Callable[[threading.Event], None], health: Health) -> None:
        self.name = name
        self.loop = loop
        self.health = health
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._supervise, name=name, daemon=True)

    def start(self) -> SupervisedThread:
        """Starts the thread."""
        self.health.running(self.name)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0, wake: Callable[[], None] | None = None) -> None:
        """Asks the loop to end (`wake` unblocks a loop that does not watch the event, as a server's
        `shutdown`) and waits for it."""
        self._stop.set()
        if wake is not None and self._thread.is_alive():
            wake()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)
        self.health.stopped(self.name)

    @property
    def alive(self) -> bool:
        """True while the thread runs (restarting included)."""
        return self._thread.is_alive()

    def _supervise(self) -> None:
        backoff = FIRST_BACKOFF_SECONDS
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.loop(self._stop)
            # the rule: any failure of the part is logged with its traceback, shown, and the part restarts
            except Exception as error:
                if time.monotonic() - started > 60.0:
                    backoff = FIRST_BACKOFF_SECONDS
                restarts = self.health.failed(self.name, error)
                log.exception(
                    "part failed, restarting part=%s restarts=%d in_seconds=%.0f", self.name, restarts, backoff
                )
                if self._stop.wait(backoff):
                    return
                backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)
                self.health.running(self.name)


def read_ledger(path: Path) -> dict[str, int]:
    """The failure counts a ledger holds ({} for none, or for one that does not read as such: it only ever
    delays setting a message aside by a few attempts)."""
    try:
        counts = json.loads(path.read_bytes())
    # no ledger yet, or a torn or foreign file: start counting afresh
    except (OSError, ValueError):
        return {}
    if not isinstance(counts, dict):
        return {}
    return {key: value for key, value in counts.items() if isinstance(key, str) and type(value) is int}


def message_key(topic: str, payload: bytes) -> str:
    """What identifies one message across redeliveries: sha256 of its topic and payload."""
    return hashlib.sha256(topic.encode() + b"\0" + payload).hexdigest()


class MessageGuard:
    """Runs a part's handler of one message under the rule: a handler that raises is counted against the message
    (by `message_key`) and the exception goes on to the part's supervisor (a thread's, which logs it and restarts
    the part, which handles the message again; or the process's, which exits with the traceback for systemd to
    restart it, and the broker delivers the message again); the ATTEMPTS-th failure sets the message aside instead:
    its payload kept in `folder` (the newest KEPT_MESSAGES), a bounded warning naming its sender, counted in
    `health`, and the caller acknowledges it. So a poison message costs a few seconds (or restarts), never the part.

    A part whose failures end the process keeps the counts in `ledger` (a JSON file of the last LEDGER_KEYS
    messages that failed), so they outlive the process."""

    def __init__(
        self, part: str, health: Health, folder: Path | None, attempts: int = ATTEMPTS, ledger: Path | None = None
    ) -> None:
        self.part = part
        self.health = health
        self.folder = folder
        self.attempts = attempts
        self.ledger = ledger
        self._failures: dict[str, int] = read_ledger(ledger) if ledger is not None else {}

    def handle(self, topic: str, payload: bytes, sender: str, handler: Callable[[], R]) -> R | None:
        """What `handler` returns for the message; None when it failed for the last time and the message was set
        aside (the same message sent again later is a new one). Re-raises a failure below the limit."""
        # hashed only while some message has failed, or when this one does (a model message is megabytes)
        key = message_key(topic, payload) if self._failures else ""
        if self._failures.get(key, 0) >= self.attempts:
            self._forget(key)
            log.warning(
                "message set aside part=%s sender=%s after failures in earlier processes", self.part, sender[:64]
            )
            self._set_aside(key, topic, payload, sender, RuntimeError("failed in earlier processes"))
            return None
        try:
            result = handler()
        except Exception as error:
            key = key or message_key(topic, payload)
            self._failures[key] = failures = self._failures.get(key, 0) + 1
            if failures < self.attempts:
                self._save()
                raise
            self._forget(key)
            log.exception("message set aside part=%s sender=%s failures=%d", self.part, sender[:64], failures)
            self._set_aside(key, topic, payload, sender, error)
            return None
        if key in self._failures:
            self._forget(key)
        return result

    def _forget(self, key: str) -> None:
        """Drops a message's count (handled, or set aside: the same message sent again later is a new one)."""
        self._failures.pop(key, None)
        self._save()

    def _save(self) -> None:
        """Writes the counts to the ledger, if the part keeps one (the newest LEDGER_KEYS)."""
        if self.ledger is not None:
            kept = dict(list(self._failures.items())[-LEDGER_KEYS:])
            atomic_write_bytes(self.ledger, json.dumps(kept).encode())

    def _set_aside(self, key: str, topic: str, payload: bytes, sender: str, error: Exception) -> None:
        """Keeps the message for inspection (a write that fails is one warning: the count and the log remain)."""
        self.health.note_set_aside(self.part, sender)
        if self.folder is None:
            return
        try:
            stamp = f"{time.time():.6f}-{key[:16]}"
            atomic_write_bytes(self.folder / f"{stamp}.payload", payload)
            note = f"topic={topic[:256]}\nsender={sender[:64]}\nerror={described(error)}\n"
            atomic_write_bytes(self.folder / f"{stamp}.txt", note.encode())
            for old in sorted(self.folder.glob("*.payload"))[:-KEPT_MESSAGES]:
                old.unlink(missing_ok=True)
                old.with_suffix(".txt").unlink(missing_ok=True)
        # a full disk or a folder that cannot be written must not stop the part: the message is set aside all the same
        except OSError as write_error:
            log.warning("set-aside message not kept part=%s error=%s", self.part, described(write_error))
