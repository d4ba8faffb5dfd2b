# Structured, quiet-by-default logging shared by the agent and coordinator command lines.
from __future__ import annotations

import logging
import sys

LOG_FORMAT = "%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"


def configure_logging(level: str) -> None:
    """key=value lines on stderr at the given level; third-party libraries stay at WARNING."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, stream=sys.stderr, force=True)
    for noisy in ("paho", "urllib3", "PIL"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
