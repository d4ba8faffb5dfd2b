# Test helper: the headless chromium of bench.browser, skipped without Debian's chromium, waits that fail the test.
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.browser import CHROMEDRIVER, CHROMIUM, WebDriver, answers, free_port, headless_chromium, wait_until

__all__ = ["ARTIFACTS", "WebDriver", "answers", "free_port", "headless_chromium", "needs_chromium", "wait_for"]

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
needs_chromium = pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
    reason="needs Debian's chromium and chromium-driver (make system-deps installs them)",
)


def wait_for(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Polls condition until it returns something truthy (returned), failing the test after timeout seconds."""
    try:
        return wait_until(condition, timeout, what)
    except TimeoutError as late:
        pytest.fail(str(late))
