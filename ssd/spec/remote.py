"""SSD's target side: the draft runs in a worker process of its own, on its own cores or GPU
(ssd/spec/worker.py), and the two talk over ssd/spec/protocol.py.

If the worker cannot start, dies, or sends nothing for `timeout` seconds, the engine logs
it, kills what is left of it, counts it in the metrics, and goes on with SD in its own
process (or with plain AR if even the draft cannot be loaded there): the outputs stay
exact, only the speed changes.
"""
import logging
import os
import subprocess
import sys
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from ssd.engine.placement import Placement, pinned
from ssd.engine.sequence import Sequence
from ssd.spec.draft_engine import DraftEngine, SpecReply, SpecRequest
from ssd.spec.protocol import (TARGET, WORKER, Channel, LinkError, connect, decode_replies, encode_requests,
                              free_port, parse_address, watch, watched_wait)
from ssd.spec.speculator import Speculator, exchange_locally

log = logging.getLogger("ssd")


class RemoteSpeculator(Speculator):
    def __init__(self, hello: dict, target: Placement, draft: Placement, *,
                 fallback: Callable[[], DraftEngine], address: str | None = None,
                 timeout: float = 60.0, startup_timeout: float = 600.0):
        """hello: the worker's configuration (see ssd/spec/worker.py). address: HOST:PORT
        to wait at for a worker started by hand (`ssd worker --connect HOST:PORT`);
        None spawns one on this machine."""
        super().__init__()
        self.target, self.draft = target, draft
        self.make_fallback = fallback
        self.timeout, self.startup_timeout = timeout, startup_timeout
        self.proc: subprocess.Popen | None = None
        self.channel: Channel | None = None
        self.vocab = 0
        self.local: DraftEngine | None = None  # the in-process SD fallback, once needed
        self.ar_only = False  # not even the fallback could load
        host, port = ("127.0.0.1", free_port()) if address is None else parse_address(address)
        try:
            self._start(hello, host, port, spawn=address is None)
        except LinkError as e:
            self._fail_over(e)

    @property
    def linked(self) -> bool:
        return self.channel is not None

    def _start(self, hello: dict, host: str, port: int, spawn: bool) -> None:
        nccl = self.target.device.type == self.draft.device.type == "cuda" and self.target.device != self.draft.device
        if spawn:
            cmd = [sys.executable, "-m", "ssd.spec.worker", "--connect", f"{host}:{port}",
                   "--device", str(self.draft), "--parent-pid", str(os.getpid())]
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
            weakref.finalize(self, _kill, self.proc)
        pg = watch(lambda: connect(host, port, TARGET, self.startup_timeout, "nccl" if nccl else "gloo"),
                   self._alive, self.startup_timeout)
        self.channel = Channel(pg, WORKER, self.target.device if nccl else torch.device("cpu"))
        self.channel.wait = watched_wait(self._alive, self.startup_timeout)
        self.channel.send(hello)

    def wait_ready(self) -> None:
        """Wait for the worker to load its model (it does so while the target loads)."""
        if self.channel is None:
            return
        try:
            msg, _ = self.channel.recv()
            if msg["type"] != "ready":
                raise LinkError(f"the draft worker could not start: {msg.get('message', msg)}")
            self.vocab = msg["vocab_size"]
            self.channel.wait = watched_wait(self._alive, self.timeout)
        except LinkError as e:
            self._fail_over(e)

    def placement(self) -> AbstractContextManager:
        """The target's share of the hardware while the worker runs: its cores, pinned."""
        return pinned(self.target.cores) if self.linked else nullcontext()

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[SpecReply]:
        try:
            return super().propose(seqs, ks)
        except LinkError as e:
            self._fail_over(e)
            return super().propose(seqs, ks)  # again, from scratch, with the fallback
        except KeyboardInterrupt:
            self._fail_over(LinkError("interrupted in the middle of an exchange"))
            raise

    def _exchange(self, requests: list[SpecRequest], release: list[int]) -> list[SpecReply]:
        if self.channel is None:
            return self._exchange_fallback(requests, release)
        self.channel.send(encode_requests(requests, release))
        msg, floats = self.channel.recv()
        if msg["type"] != "reply":
            raise LinkError(f"the draft worker failed: {msg.get('message', msg)}")
        self.timings = msg["timings"]
        return decode_replies(msg, floats, self.vocab)

    def _exchange_fallback(self, requests: list[SpecRequest], release: list[int]) -> list[SpecReply]:
        self.timings = {}
        if self.local is None and not self.ar_only:
            try:
                self.local = self.make_fallback()
            except Exception as e:  # out of memory, a file gone since start-up, ...
                log.warning("ssd: cannot load the draft model in this process either (%s: %s); "
                            "continuing with plain decoding", type(e).__name__, e)
                self.ar_only = True
        if self.local is None:
            return [SpecReply([], None, None) for _ in requests]
        return exchange_locally(self.local, requests, release)

    def _fail_over(self, error: Exception) -> None:
        self.failures += 1
        log.warning("ssd: %s; continuing with speculative decoding in this process", error)
        self.channel = None
        self._shutdown(grace=0.0)
        self.known, self.released, self.timings = {}, [], {}

    def _alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    def close(self) -> None:
        if self.channel is not None:
            try:
                self.channel.wait = watched_wait(self._alive, 2.0)
                self.channel.send({"type": "close"})
            except (LinkError, KeyboardInterrupt):
                pass
            self.channel = None
        self._shutdown(grace=5.0)

    def _shutdown(self, grace: float) -> None:
        if self.proc is not None:
            _kill(self.proc, grace)


def _kill(proc: subprocess.Popen, grace: float = 0.0) -> None:
    """End the worker: let it exit on its own for `grace` seconds, then kill it, and reap it."""
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
