# The runtime's one exception root, and the user's mistake: the only error a command line shows as one line.
from __future__ import annotations


class FalError(Exception):
    """The root of every error the runtime raises on purpose: wire, codec, chunking, broker, rejection, usage."""


class UsageError(FalError, ValueError):
    """A mistake a person made (a flag, a file, a spec, a data set): the command prints its text in one line and
    exits 2. Anything else that escapes a command is a bug and shows its traceback."""
