# The runtime's one exception root, the errors that refuse a message (each with its RejectionKind), and the user's
# mistake: the only error a command line shows as one line.
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (messages imports model_spec, which may raise a UsageError: no import at run time)
    from protocol.messages import RejectionKind


class FalError(Exception):
    """The root of every error the runtime raises on purpose: wire, codec, chunking, broker, rejection, usage."""


class UsageError(FalError, ValueError):
    """A mistake a person made (a flag, a file, a spec, a data set): the command prints its text in one line and
    exits 2. Anything else that escapes a command is a bug and shows its traceback."""


class RefusalError(FalError):
    """An error that refuses a message: `kind` names the refusal as acks, the store and metrics do (a class sets it
    when all its refusals are of one kind, an instance when they differ)."""

    kind: RejectionKind
