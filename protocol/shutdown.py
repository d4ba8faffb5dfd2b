# A stop request (SIGTERM) as an exception on the main thread, so every `finally` runs: status, broker, children.
from __future__ import annotations

import signal
from types import FrameType


class Terminated(BaseException):
    """Raised on the main thread when the process is asked to stop (SIGTERM), whatever it was doing: reconnecting,
    training, waiting for a label. Everything a device keeps is written atomically, so stopping anywhere loses
    nothing that a kill would not."""


def _raise_once(signum: int, frame: FrameType | None) -> None:
    """Raises Terminated and ignores further SIGTERMs, so the cleanup the first one starts is not cut short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated(f"stopped by signal {signal.Signals(signum).name}")


def raise_on_sigterm() -> None:
    """Makes SIGTERM raise Terminated on the main thread (call it from the main thread, before the work starts)."""
    signal.signal(signal.SIGTERM, _raise_once)
