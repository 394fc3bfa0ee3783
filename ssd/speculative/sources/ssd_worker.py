"""SSD's target side: the draft runs in a worker process of its own, on its own cores or GPU
(ssd/speculative/link/worker.py), and the two talk over ssd/speculative/link/protocol.py.

A worker this engine starts sits in its own session (a terminal's Ctrl-C does not reach it)
and listens only on the loopback; the engine ends it. If it cannot start, dies, breaks the
protocol, or sends nothing for `timeout` seconds, the engine logs it, kills what is left of
it, counts it in the metrics, and goes on with SD in its own process (or with plain AR if
even the draft cannot be loaded there): the outputs stay exact, only the speed changes.
Ctrl-C while waiting for the worker is not a failure: the worker is ended, the interrupt goes
on to the caller, and the next round starts a fresh worker.

The link is ended in one order whatever ends it (close, a failure, Ctrl-C): the worker goes
(one this engine started is killed, which fails a wait on it at once; one started by hand
answers the wait in flight), the helper threads left in gloo's waits are joined, and the
process group is aborted, so that nothing of the link runs on when the process exits.
"""
import logging
import os
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from ssd.distributed.link import (TARGET, WORKER, LinkError, Watcher, connect, listen_socket, new_secret,
                             parse_address)
from ssd.distributed.placement import Placement, pinned
from ssd.request.sequence import Sequence
from ssd.speculative.draft.draft_engine import DraftEngine
from ssd.speculative.link.protocol import Channel, Limits, QueueChannel, SpecRequest, decode_replies, encode_requests
from ssd.speculative.link.worker import serve_in_thread
from ssd.speculative.options import SECRET_ENV, DraftConfig
from ssd.speculative.plan import SeqPlan
from ssd.speculative.records import Proposal
from ssd.speculative.sources.base import DraftSource
from ssd.speculative.sources.draft_model import propose_locally

log = logging.getLogger("ssd")


class SSDWorker(DraftSource):
    def __init__(self, config: DraftConfig, target: Placement, draft: Placement, context: int, *,
                 fallback: Callable[[], DraftEngine], address: str | None = None, secret: str | None = None,
                 timeout: float = 60.0, startup_timeout: float = 600.0, in_thread: bool = False):
        """config: what the worker builds. address: HOST:PORT to wait at for a worker started
        by hand (`ssd worker --connect HOST:PORT`, knowing `secret`); None starts one here: a
        process, or with `in_thread` a thread of this one (worker.serve_in_thread: one GPU for
        both, the draft on a CUDA stream of its own). context: the positions the draft model holds."""
        super().__init__(context)
        self.weights = config.weights
        self.config, self.target, self.draft = config, target, draft
        self.address, self.secret = address, secret
        self.make_fallback = fallback
        self.timeout, self.startup_timeout = timeout, startup_timeout
        self.proc: subprocess.Popen | None = None
        self.in_thread = in_thread
        self.thread: threading.Thread | None = None
        self.listener: socket.socket | None = None
        self.channel: Channel | None = None
        self.watcher = Watcher(self._alive, startup_timeout)  # every blocking call on the link
        self.vocab = 0
        self.local: DraftEngine | None = None  # the in-process SD fallback, once needed
        self.ar_only = False  # not even the fallback could load
        self.restart = False  # an interrupt ended the worker: start another for the next round
        self.released: list[int] = []  # sequences the worker may forget, told with the next message
        self._connect()

    def _connect(self) -> None:
        try:
            self._start()
        except LinkError as e:
            self._fail_over(e)

    def _start(self) -> None:
        if self.in_thread:
            self.watcher.timeout = self.startup_timeout
            self.channel, theirs = QueueChannel.pair(self.watcher)
            self.thread = threading.Thread(target=serve_in_thread, args=(theirs, self.draft.device), daemon=True,
                                           name="ssd-draft-worker")
            self.thread.start()
            self.channel.send({"type": "hello", "config": self.config.as_dict()})
            return
        nccl = self.target.device.type == self.draft.device.type == "cuda" and self.target.device != self.draft.device
        if self.address is None:
            host, secret = "127.0.0.1", new_secret()
            self.listener = listen_socket(host)
            port = self.listener.getsockname()[1]
            cmd = [sys.executable, "-m", "ssd.cli", "worker", "--connect", f"{host}:{port}",
                   "--device", str(self.draft), "--parent-pid", str(os.getpid())]
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True,
                                         env={**os.environ, SECRET_ENV: secret})
            weakref.finalize(self, _kill, self.proc)
        else:
            (host, port), secret = parse_address(self.address), self.secret
            self.listener = listen_socket(host, port)
        self.watcher.timeout = self.startup_timeout
        pg = self.watcher(lambda: connect(host, port, TARGET, self.startup_timeout, secret,
                                          backend="nccl" if nccl else "gloo", listener=self.listener))
        self.channel = Channel(pg, WORKER, self.target.device if nccl else torch.device("cpu"))
        self.channel.wait = self.watcher.wait
        self.channel.send({"type": "hello", "config": self.config.as_dict()})

    def wait_ready(self) -> None:
        """Wait for the worker to load its model (it does so while the target loads)."""
        if self.channel is None:
            return
        try:
            msg, _ = self.channel.recv()
            if msg["type"] != "ready":
                raise LinkError(f"the draft worker could not start: {msg.get('message', msg)}")
            self.vocab = int(msg["vocab_size"])
            cfg = self.config
            self.channel.limits = Limits.for_config(cfg.max_num_seqs, cfg.max_model_len, cfg.k_max, self.vocab)
            self.watcher.timeout = self.timeout
        except (LinkError, KeyError, TypeError, ValueError) as e:
            self._fail_over(e if isinstance(e, LinkError) else LinkError(f"a bad ready message: {e}"))
        except KeyboardInterrupt:
            self._interrupted()
            raise

    def placement(self, drafting: bool = True) -> AbstractContextManager:
        """The target's share of the hardware while the worker runs: its cores, pinned. A
        step of prompts alone gives the worker nothing to do, so a worker this engine started
        on cores of this machine lends them to the target's prefill (a shorter time to the
        first token)."""
        if self.channel is None or self.thread is not None:  # a thread: no cores of its own
            return nullcontext()
        cores = self.target.cores
        if not drafting and cores and self.proc is not None and self.draft.cores:
            cores = tuple(sorted({*cores, *self.draft.cores}))
        return pinned(cores)

    def propose(self, seqs: list[Sequence], plans: list[SeqPlan]) -> list[Proposal]:
        if self.restart:
            self.restart = False
            self._connect()
            self.wait_ready()
        if self.channel is None:
            return self._propose_locally(seqs, plans)
        try:
            return self._exchange(seqs, plans)
        except LinkError as e:
            self._fail_over(e)
            proposals = self._propose_locally(seqs, plans)  # again, from scratch, in this process
            for p in proposals:
                p.failed_over = True
            return proposals
        except KeyboardInterrupt:
            self._interrupted()
            raise

    def _exchange(self, seqs: list[Sequence], plans: list[SeqPlan]) -> list[Proposal]:
        requests = [SpecRequest(seq.seq_id, num_valid, new, p.k, params)
                    for seq, p in zip(seqs, plans) for num_valid, new, params in [self.next_update(seq)]]
        self.channel.send(encode_requests(requests, self._take_released()))
        msg, floats = self.channel.recv()
        if msg["type"] != "reply":
            raise LinkError(f"the draft worker failed: {msg.get('message', msg)}")
        return decode_replies(msg, floats, self.vocab, requests)

    def release(self, seq_id: int) -> None:
        """The worker is told with the next message; the fallback in this process at once."""
        if self.known.pop(seq_id, None) is None:
            return
        if self.channel is not None:
            self.released.append(seq_id)
        elif self.local is not None:
            self.local.release(seq_id)

    def _take_released(self) -> list[int]:
        released, self.released = self.released, []
        return released

    def held(self) -> dict[str, int]:
        """What is held per sequence here, in the fallback, and in the worker (asked over the
        link, which also tells it the sequences released since the last message)."""
        held = {"sequences": len(self.known), **(self.local.held() if self.local else {})}
        if self.channel is not None:
            try:
                self.channel.send({"type": "held", "release": self._take_released()})
                msg, _ = self.channel.recv()
                if msg["type"] != "held":
                    raise LinkError(f"the draft worker failed: {msg.get('message', msg)}")
                held.update({f"worker's {what}": int(n) for what, n in msg["held"].items()})
            except (LinkError, KeyError, TypeError, ValueError, AttributeError) as e:
                self._fail_over(e if isinstance(e, LinkError) else LinkError(f"a bad held message: {e}"))
        return held

    def _propose_locally(self, seqs: list[Sequence], plans: list[SeqPlan]) -> list[Proposal]:
        if self.local is None and not self.ar_only:
            try:
                self.local = self.make_fallback()
            except Exception as e:  # out of memory, a file gone since start-up, ...
                log.warning("ssd: cannot load the draft model in this process either (%s: %s); "
                            "continuing with plain decoding", type(e).__name__, e)
                self.ar_only = True
        if self.local is None:
            return [Proposal([]) for _ in seqs]
        return propose_locally(self, self.local, seqs, plans)

    def _fail_over(self, error: Exception) -> None:
        self.failures += 1
        log.warning("ssd: %s; continuing with speculative decoding in this process", error)
        self._drop_link()

    def _interrupted(self) -> None:
        """Ctrl-C in the middle of an exchange: the link's state is unknown, so the worker is
        ended (not counted as a failure) and the next round starts another."""
        self._drop_link()
        self.restart = True

    def _drop_link(self) -> None:
        self._end_link(grace=0.0)
        self.known, self.released = {}, []  # the worker's state is gone with it

    def _alive(self) -> bool:
        if self.thread is not None:
            return self.thread.is_alive()
        return self.proc is None or self.proc.poll() is None

    def close(self) -> None:
        if self.channel is not None:
            try:
                self.watcher.timeout = 2.0
                self.channel.send({"type": "close"})
            except (LinkError, KeyboardInterrupt):
                pass
        self.restart = False
        self._end_link(grace=5.0)

    def _end_link(self, grace: float) -> None:
        """End the link in order (module doc): the worker (waited for `grace` seconds if it was
        told to close), the helper threads, the process group."""
        channel, self.channel = self.channel, None
        if self.thread is not None:
            if channel is not None and grace == 0.0:  # not told to close yet: it returns at this message
                channel.send({"type": "close"})
            self.thread.join(max(grace, 5.0))
            self.thread = None
            return
        if self.proc is not None:
            _kill(self.proc, grace)
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        # A killed worker fails the wait in flight at once; one started by hand answers it soon.
        if not self.watcher.join(5.0):
            log.warning("ssd: a wait on the draft worker's link is still blocked")
        if channel is not None:
            channel.pg.abort()


def _kill(proc: subprocess.Popen, grace: float = 0.0) -> None:
    """End the worker: let it exit on its own for `grace` seconds, then kill it, and reap it."""
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
