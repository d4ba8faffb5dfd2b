# The one error root: every error the runtime raises on purpose is a FalError; each refusal names its RejectionKind.
from __future__ import annotations

import pytest

from coordinator.validation import Rejection
from protocol.chunks import ChunkingError
from protocol.errors import FalError, RefusalError, UsageError
from protocol.messages import RejectionKind
from protocol.mqtt import BrokerUnavailableError, PayloadTooLargeError
from protocol.update_codec import CodecError
from protocol.wire import WireError

ROOTED = (WireError, CodecError, ChunkingError, PayloadTooLargeError, BrokerUnavailableError, Rejection, UsageError)


@pytest.mark.parametrize("error", ROOTED)
def test_every_error_is_a_fal_error(error: type[Exception]) -> None:
    assert issubclass(error, FalError)


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
