"""A real headless browser for the tests of pages batchfit writes (Debian's chromium
driven by playwright). Where no chromium is installed the browser tests are skipped, except
in CI (``CI=true``), where ``make test`` installs it and a missing browser is a failure.

With ``BATCHFIT_SCREENSHOTS=FOLDER`` (e.g. ``docs/images``), the tests also save what they
saw there as PNG files (:func:`screenshot`): the pictures of the docs are made this way."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

#: The working directory at collection, before any test changes it.
_STARTED_IN = Path.cwd()


def chromium_path() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)


@contextmanager
def open_page(url: str, width: int = 1200, height: int = 900) -> Iterator[tuple[Any, list[str]]]:
    """The page at ``url`` in headless chromium, and the console errors it logs."""
    executable = chromium_path()
    if executable is None:
        if os.environ.get("CI"):
            pytest.fail("no chromium: make test installs Debian's chromium for the browser tests")
        pytest.skip("no chromium installed (apt-get install chromium)")
    playwright = pytest.importorskip("playwright.sync_api")
    errors: list[str] = []
    with playwright.sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=executable,
                                         args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url)
            yield page, errors
        finally:
            browser.close()


def screenshot(page: Any, name: str, full_page: bool = True) -> Path | None:
    """Save the page as ``$BATCHFIT_SCREENSHOTS/NAME`` when that variable names a folder
    (created if missing); None when it is unset."""
    folder = os.environ.get("BATCHFIT_SCREENSHOTS")
    if not folder:
        return None
    path = _STARTED_IN / folder / name  # a relative folder: from where pytest started
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path), full_page=full_page)
    return path
