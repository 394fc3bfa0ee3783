"""`ssd serve` started as a user starts it: a subprocess on 127.0.0.1 at a free port."""
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    log: str  # path of its stdout + stderr

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def metrics(self) -> dict[str, float]:
        """The Prometheus samples as {'name{labels}': value}."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {m[1]: float(m[2]) for m in re.finditer(r"^([a-z_]+(?:\{[^}]*\})?) (\S+)$", text, re.M)}

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """The metrics once no request runs or waits and no KV block is held (target or SD draft)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["ssd_requests_running"] == 0 and m["ssd_requests_waiting"] == 0 and m["ssd_kv_cache_blocks_used"] == 0
                    and m["ssd_draft_kv_cache_blocks_used"] == 0):
                return m
            assert time.monotonic() < deadline, f"the server did not go idle: {m}"
            time.sleep(0.1)

    def children(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(x) for x in out.split()]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def start_server(*args: str, tmp_path, env: dict | None = None, timeout: float = 180.0) -> Server:
    port = free_port()
    log = str(tmp_path / f"serve-{port}.log")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ssd.cli", "serve", "--port", str(port), *args],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"ssd serve exited with {proc.returncode}:\n{open(log).read()}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            server.stop(signal.SIGKILL)
            raise AssertionError(f"ssd serve did not come up in {timeout} s:\n{open(log).read()}")
        time.sleep(0.25)
