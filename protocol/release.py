# The release this code is: the one place its version is written (pyproject.toml and `--version` read it here).
from __future__ import annotations

VERSION = "0.5.0"
