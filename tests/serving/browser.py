"""A headless Debian chromium driven by selenium (chromium-driver), for the chat-page test; screenshots go to
``$FXCOMPILER_TEST_ARTIFACTS`` (default ``test-artifacts/`` in the repository root, git-ignored)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SETUP_HINT = ("install them with `bash scripts/setup_browser.sh` as root (apt-get install chromium "
              "chromium-driver); `bash scripts/test.sh` does this on a fresh machine")


def artifacts_dir() -> Path:
    path = Path(os.environ.get("FXCOMPILER_TEST_ARTIFACTS") or REPO / "test-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def browser_paths() -> tuple[str, str]:
    """(chromium, chromedriver); the test FAILS (never skips) when either is missing."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    missing = [name for name, path in (("chromium", chromium), ("chromedriver", driver)) if not path]
    if missing:
        pytest.fail(f"the chat-page browser test needs {' and '.join(missing)} on PATH: {SETUP_HINT}", pytrace=False)
    return chromium, driver


def start_browser(profile_dir: Path):
    """One headless chromium session (the caller quits it)."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("the chat-page browser test needs selenium (the `test` extra of pyproject.toml)", pytrace=False)
    chromium, driver = browser_paths()
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1100,760", "--disable-extensions", "--no-first-run", "--no-default-browser-check",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-default-apps", "--mute-audio", f"--user-data-dir={profile_dir}"):
        opts.add_argument(flag)
    service = Service(executable_path=driver, log_output=str(profile_dir / "chromedriver.log"))
    return webdriver.Chrome(options=opts, service=service)
