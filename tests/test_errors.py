# The one error root: every error the runtime raises on purpose is a FalError; each refusal names its RejectionKind.
from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from coordinator.intake.validation import Rejection
from protocol.chunks import ChunkingError
from protocol.errors import FalError, RefusalError, UsageError
from protocol.messages import RejectionKind
from protocol.mqtt import BrokerUnavailableError, PayloadTooLargeError
from protocol.update_codec import CodecError
from protocol.wire import WireError

ROOTED = (WireError, CodecError, ChunkingError, PayloadTooLargeError, BrokerUnavailableError, Rejection, UsageError)


ROOMS = ("protocol", "edge_agent", "export", "coordinator", "bench")
STOP_REQUEST = "protocol.shutdown.Terminated"  # SIGTERM as a BaseException, so no `except Exception` swallows it


def errors_defined_in_the_rooms() -> list[type[BaseException]]:
    """Every exception class a runtime or bench module defines, found by importing each module of the rooms."""
    found = []
    for room in ROOMS:
        package = importlib.import_module(room)
        for module_info in pkgutil.walk_packages(package.__path__, f"{room}."):
            if module_info.name.endswith(".__main__"):  # running it is the console script
                continue
            module = importlib.import_module(module_info.name)
            found += [
                cls
                for _, cls in inspect.getmembers(module, inspect.isclass)
                if issubclass(cls, BaseException) and cls.__module__ == module.__name__
            ]
    return found


@pytest.mark.parametrize("error", ROOTED)
def test_every_error_is_a_fal_error(error: type[Exception]) -> None:
    assert issubclass(error, FalError)


def test_no_module_defines_an_error_outside_the_root() -> None:
    defined = errors_defined_in_the_rooms()
    assert len(defined) >= len(ROOTED)
    outside = [f"{cls.__module__}.{cls.__qualname__}" for cls in defined if not issubclass(cls, FalError)]
    assert outside == [STOP_REQUEST]


@pytest.mark.parametrize(
    ("refusal", "kind"),
    [
        (WireError("undecodable msgpack"), RejectionKind.UNDECODABLE),
        (ChunkingError("too many chunks"), RejectionKind.BAD_CHUNK),
        (PayloadTooLargeError("too large"), RejectionKind.TOO_LARGE),
        (CodecError(RejectionKind.BAD_ENCODING, "no scales"), RejectionKind.BAD_ENCODING),
        (Rejection(RejectionKind.REPLAY, "nonce seen"), RejectionKind.REPLAY),
    ],
)
def test_each_refusing_error_names_its_rejection_kind(refusal: RefusalError, kind: RejectionKind) -> None:
    assert isinstance(refusal, RefusalError) and refusal.kind == kind


@pytest.mark.parametrize("error", [WireError, CodecError, ChunkingError, PayloadTooLargeError])
def test_errors_caught_as_value_errors_still_are(error: type[Exception]) -> None:
    assert issubclass(error, ValueError)


def test_an_unreachable_broker_is_a_usage_error_shown_in_one_line() -> None:
    assert issubclass(BrokerUnavailableError, UsageError)
    assert not issubclass(BrokerUnavailableError, RefusalError)
