# Test helper: the headless chromium of bench.browser, skipped without Debian's chromium, waits that fail the test.
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.browser import CHROMEDRIVER, CHROMIUM, WebDriver, answers, free_port, headless_chromium

__all__ = ["ARTIFACTS", "WebDriver", "answers", "free_port", "headless_chromium", "needs_chromium", "wait_for"]

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
needs_chromium = pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
    reason="needs Debian's chromium and chromium-driver (make system-deps installs them)",
)


def wait_for(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Polls condition until it returns something truthy (returned), failing the test after timeout seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
