"""Headless Chromium driven by selenium, for the chat page's tests (tests/test_page.py) and
its screenshot (bench/page_screenshot.py): Debian's chromium and chromium-driver, nothing
downloaded at run time (selenium's own driver manager is never asked: both paths are given).
"""
import os
import shutil
import subprocess
from pathlib import Path

from ssd.errors import SSDError

CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
INSTALL = "apt-get update && apt-get install -y chromium chromium-driver"
# Without these, Chromium keeps trying to reach its vendor's hosts at every start, which a
# closed network refuses many at a time.
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars")


def ensure_chromium() -> None:
    """Debian's Chromium and its driver, installed with apt-get where they are missing and this
    process may (root with apt-get); else an SSDError saying what to install."""
    if os.path.exists(CHROMIUM) and os.path.exists(DRIVER):
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SSDError(f"the page's browser tests need Debian's chromium and chromium-driver ({CHROMIUM}, "
                       f"{DRIVER}): run `{INSTALL}` as root")
    done = subprocess.run(["sh", "-c", INSTALL], env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
                          capture_output=True, text=True)
    if done.returncode != 0 or not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)):
        raise SSDError(f"`{INSTALL}` failed ({done.returncode}):\n{done.stderr[-2000:]}")


def chromium(profile: Path, width: int = 1400, height: int = 1000):
    """A headless Chromium with a new profile in `profile`, driven by selenium."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    ensure_chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    options.add_argument(f"--window-size={width},{height}")
    return webdriver.Chrome(options=options, service=Service(executable_path=DRIVER))
