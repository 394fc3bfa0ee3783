"""The draft worker's message protocol: the target (rank 0) and the draft worker (rank 1) talk
over a torch.distributed point-to-point process group (gloo on CPU, NCCL between GPUs).

Every message is three sends: a header tensor int64 [2] = (bytes of JSON, floats that
follow), the JSON body as uint8, then, if any, one float32 tensor (the draft distributions q).
JSON rather than pickle: a worker may sit on another host, and JSON cannot run code.

The conversation:
    target -> worker  {"type": "hello", ...config}            once, after connecting
    worker -> target  {"type": "ready", "vocab_size", "pid"}  or {"type": "error", "message"}
    target -> worker  {"type": "step", "release": [ids], "requests": [[seq_id, num_valid,
                       new_tokens, k, params or null], ...]}
    worker -> target  {"type": "reply", "replies": [[tokens, hit, q_rows], ...],
                       "timings": {"backup_s", "tree_s", "idle_s", "branches"}}  + q rows stacked
    target -> worker  {"type": "close"}
After each reply the worker builds the speculation cache for the speculations it just sent,
while the target verifies them; the timings in a reply are those of the previous build.
"""
import datetime
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from ssd.errors import SSDError
from ssd.sampling_params import SamplingParams
from ssd.spec.draft_engine import SpecReply, SpecRequest

TARGET, WORKER = 0, 1
NO_TIMEOUT = datetime.timedelta(days=1)  # liveness is watched by the target, not by gloo
T = TypeVar("T")


class LinkError(RuntimeError):
    """The draft worker died, hung past its timeout or broke the protocol."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connect(host: str, port: int, rank: int, timeout: float, backend: str | None = None
            ) -> dist.ProcessGroup:
    """A two-process group of its own (not the global default group, so several engines can
    live in one process). The target (rank 0) hosts the rendezvous store and chooses the
    backend; the worker reads it from there."""
    store = dist.TCPStore(host, port, 2, rank == TARGET, timeout=datetime.timedelta(seconds=timeout),
                          wait_for_workers=False)
    if rank == TARGET:
        store.set("ssd_backend", backend)
    else:
        backend = store.get("ssd_backend").decode()
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, 2)
    return dist.ProcessGroupGloo(store, rank, 2, NO_TIMEOUT)


class Channel:
    def __init__(self, pg: dist.ProcessGroup, peer: int, device: torch.device):
        self.pg, self.peer, self.device = pg, peer, device
        # Blocks until a peer's work completes; the target replaces it with a watched wait.
        self.wait: Callable[[dist.Work], None] = lambda work: work.wait()

    def send(self, msg: dict, floats: torch.Tensor | None = None) -> None:
        body = torch.frombuffer(bytearray(json.dumps(msg).encode()), dtype=torch.uint8)
        n = 0 if floats is None else floats.numel()
        for t in (torch.tensor([body.numel(), n]), body, floats):
            if t is not None and t.numel():
                self.wait(self.pg.send([t.to(self.device).contiguous()], self.peer, 0))

    def recv(self) -> tuple[dict, torch.Tensor | None]:
        header = self._recv(torch.empty(2, dtype=torch.long))
        body = self._recv(torch.empty(int(header[0]), dtype=torch.uint8))
        floats = self._recv(torch.empty(int(header[1]), dtype=torch.float32)) if header[1] else None
        return json.loads(bytes(body.cpu().numpy())), floats

    def _recv(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self.device)
        if t.numel():
            self.wait(self.pg.recv([t], self.peer, 0))
        return t


def watch(fn: Callable[[], T], alive: Callable[[], bool], timeout: float) -> T:
    """fn() in a helper thread, watched: gives up when the peer process is gone or `timeout`
    seconds pass, and Ctrl-C interrupts it. gloo's waits block in C++ until done, and a
    timed-out gloo wait closes the link for good, so they cannot be sliced."""
    done, out, error = threading.Event(), [], []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as e:  # the peer closed the connection, the store timed out, ...
            error.append(e)
        done.set()

    threading.Thread(target=run, daemon=True, name="ssd-draft-wait").start()
    deadline = time.monotonic() + timeout
    while not done.wait(0.05):
        if not alive():
            raise LinkError("the draft worker died")
        if time.monotonic() > deadline:
            raise LinkError(f"the draft worker did not answer within {timeout:.0f} s")
    if error:
        # A dead worker shows up as a reset connection, often before the process is reaped.
        for _ in range(10):
            if not alive():
                raise LinkError("the draft worker died")
            time.sleep(0.05)
        raise LinkError(f"the link to the draft worker broke: {error[0]}")
    return out[0]


def watched_wait(alive: Callable[[], bool], timeout: float) -> Callable[[dist.Work], None]:
    return lambda work: watch(work.wait, alive, timeout)


# ---- step messages ------------------------------------------------------------------------
DRAFT_PARAMS = ("temperature", "top_k", "top_p", "seed")  # what drafting needs of a request


def params_to_wire(p: SamplingParams) -> dict:
    return {name: getattr(p, name) for name in DRAFT_PARAMS}


def params_from_wire(d: dict) -> SamplingParams:
    return SamplingParams(**{name: d[name] for name in DRAFT_PARAMS})


def encode_requests(requests: list[SpecRequest], release: list[int]) -> dict:
    return {"type": "step", "release": release,
            "requests": [[r.seq_id, r.num_valid, r.new_tokens, r.k,
                          None if r.params is None else params_to_wire(r.params)] for r in requests]}


def decode_requests(msg: dict) -> tuple[list[SpecRequest], list[int]]:
    return ([SpecRequest(i, n, new, k, None if p is None else params_from_wire(p))
             for i, n, new, k, p in msg["requests"]], msg["release"])


def encode_replies(replies: list[SpecReply], timings: dict) -> tuple[dict, torch.Tensor | None]:
    qs = [r.q for r in replies if r.q is not None]
    msg = {"type": "reply", "timings": timings,
           "replies": [[r.tokens, r.hit, 0 if r.q is None else r.q.shape[0]] for r in replies]}
    return msg, torch.cat(qs).float() if qs else None


def decode_replies(msg: dict, floats: torch.Tensor | None, vocab: int) -> list[SpecReply]:
    rows = floats.view(-1, vocab) if floats is not None else None
    out, start = [], 0
    for tokens, hit, n in msg["replies"]:
        out.append(SpecReply(tokens, rows[start:start + n] if n else None, hit))
        start += n
    return out


def parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise SSDError(f"bad draft address {address!r}: expected HOST:PORT")
    return host, int(port)
