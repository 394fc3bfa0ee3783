"""The chat page's screenshot in docs/: `ssd serve` with the default pair (SD, auto-K), a code
question asked in the page in headless Chromium: first another one of its kind decoded
plainly (speculation off; not the same one, which suffix decoding would then copy from the
first answer), then in a new conversation the question with speculation, whose answer's
accepted drafts are marked and whose speed the page compares with the plain one's; saved as
a PNG once the answer ends.

    python bench/page_screenshot.py --out docs/images/page.png

Needs Debian's chromium and chromium-driver (installed with apt-get where missing, as root)
and selenium (the test extra)."""
import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from ssd.bench.browser import chromium

QUESTION = "Write a Python function that returns the n-th Fibonacci number, with a short docstring."
PLAIN = "Write a Python function that tells whether a string is a palindrome, with a short docstring."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answered(driver, timeout: float = 600) -> str:
    """The answer's stats line, once the answer has ended."""
    deadline = time.monotonic() + timeout
    while True:
        stats = driver.find_elements("css selector", ".message.assistant .stats")
        if stats and stats[-1].text:
            return stats[-1].text
        if time.monotonic() > deadline:
            raise SystemExit(f"the answer did not end in {timeout:.0f} s")
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/images/page.png")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--question", default=QUESTION)
    ap.add_argument("--plain-question", default=PLAIN)
    ap.add_argument("--max-tokens", type=int, default=200)
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "ssd.cli", "serve", "--model", args.model, "--draft", args.draft,
                               "--mode", "sd", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                raise SystemExit(f"ssd serve exited: {server.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("ssd serve did not come up in 10 minutes")
            time.sleep(0.5)
        with tempfile.TemporaryDirectory() as profile:
            driver = chromium(Path(profile), width=1360, height=940)
            try:
                driver.get(url + "/")
                tokens = driver.find_element("id", "max-tokens")
                tokens.clear()
                tokens.send_keys(str(args.max_tokens))
                for speculate, question in ((False, args.plain_question), (True, args.question)):
                    if driver.find_element("id", "speculate").is_selected() != speculate:
                        driver.find_element("id", "speculate").click()
                    driver.find_element("id", "reset").click()
                    driver.find_element("id", "message").send_keys(question)
                    driver.find_element("id", "send").click()
                    print(("speculating: " if speculate else "plain: ") + answered(driver))
                os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
                driver.save_screenshot(args.out)
            finally:
                driver.quit()
    finally:
        server.terminate()
        server.wait(60)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
