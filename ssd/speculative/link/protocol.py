"""The draft worker's message protocol: the target (rank 0) and the draft worker (rank 1) talk
over a torch.distributed point-to-point process group (gloo on CPU, NCCL between GPUs).

Connecting, authenticating and watching the link: ssd/distributed/link.py.

Every message is three sends: a header tensor int64 [2] = (bytes of JSON, floats that follow),
the JSON body as uint8, then, if any, one float32 tensor (the draft distributions q). JSON
rather than pickle: a worker may sit on another host, and JSON cannot run code. A receiver
refuses a header beyond the limits the configuration implies (`Limits`) before allocating
anything, and a malformed body: either is a broken link (LinkError), never a crash.

The conversation:
    target -> worker  {"type": "hello", "config": DraftConfig as a dict}    once, after connecting
    worker -> target  {"type": "ready", "vocab_size", "pid"}  or {"type": "error", "message"}
    target -> worker  {"type": "step", "release": [ids], "requests": [[seq_id, num_valid,
                       new_tokens, k, params or null], ...]}
    worker -> target  {"type": "reply", "replies": [[tokens, hit, q_rows, tree_s, backup_s, idle_s], ...]}
                      + q rows stacked
    target -> worker  {"type": "held", "release": [ids]}      what the worker holds per sequence
    worker -> target  {"type": "held", "held": {structure: count}}
    target -> worker  {"type": "close"}
After each reply the worker builds the speculation cache for the speculations it just sent,
while the target verifies them; a reply's timings are the previous build's share of each
sequence, the backup time spent on it in this step, and how long the worker waited.
"""
import json
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ssd.distributed.link import LinkError, Watcher
from ssd.sampling_params import SamplingParams
from ssd.speculative.records import Proposal

# ---- messages ---------------------------------------------------------------------------------
@dataclass
class SpecRequest:
    """The target's word on one sequence at the start of a round."""

    seq_id: int
    num_valid: int  # leading tokens of what the draft holds (confirmed + speculation) that are right
    new_tokens: list[int]  # the target's tokens after those (its recovery/bonus token; a prompt at first)
    k: int  # draft tokens wanted
    params: SamplingParams | None = None  # with a sequence's first request


@dataclass(frozen=True)
class Limits:
    """The largest message a peer may send: what the configuration can need, with room to spare."""

    json_bytes: int = 4 << 20  # until the hello: a configuration (with a reduced vocabulary, up to ~1 MB)
    floats: int = 0

    @classmethod
    def for_config(cls, max_num_seqs: int, max_model_len: int, k: int, vocab: int) -> "Limits":
        # Requests: every sequence's whole context (a prompt) at up to 12 bytes a token id.
        return cls(json_bytes=(1 << 20) + max_num_seqs * (12 * max_model_len + 4096),
                   floats=max_num_seqs * k * vocab)


# ---- connecting -------------------------------------------------------------------------------
# ---- sending and receiving --------------------------------------------------------------------
class Channel:
    def __init__(self, pg: dist.ProcessGroup, peer: int, device: torch.device):
        self.pg, self.peer, self.device = pg, peer, device
        self.limits = Limits()
        # Blocks until a peer's work completes; the target replaces it with a watched wait.
        self.wait: Callable[[dist.Work], None] = lambda work: work.wait()

    def send(self, msg: dict, floats: torch.Tensor | None = None) -> None:
        body = torch.frombuffer(bytearray(json.dumps(msg).encode()), dtype=torch.uint8)
        n = 0 if floats is None else floats.numel()
        for t in (torch.tensor([body.numel(), n]), body, floats):
            if t is not None and t.numel():
                self.wait(self.pg.send([t.to(self.device).contiguous()], self.peer, 0))

    def recv(self) -> tuple[dict, torch.Tensor | None]:
        header = self._recv(torch.empty(2, dtype=torch.long)).tolist()
        size, n = header
        if not (0 < size <= self.limits.json_bytes and 0 <= n <= self.limits.floats):
            raise LinkError(f"the peer sent a message header of {size} bytes and {n} floats, beyond what this "
                            f"link allows ({self.limits.json_bytes} bytes, {self.limits.floats} floats)")
        body = self._recv(torch.empty(size, dtype=torch.uint8))
        floats = self._recv(torch.empty(n, dtype=torch.float32)) if n else None
        try:
            msg = json.loads(bytes(body.cpu().numpy()))
        except ValueError as e:
            raise LinkError(f"the peer sent a malformed message: {e}") from None
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            raise LinkError("the peer sent a message without a type")
        return msg, floats

    def _recv(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self.device)
        if t.numel():
            self.wait(self.pg.recv([t], self.peer, 0))
        return t


class QueueChannel:
    """Channel's interface over two queues: an SSD worker that is a thread of this process (one
    GPU shared by target and draft, the draft on a CUDA stream of its own). Messages pass as
    they would over the wire (JSON); the floats tensor stays on its device, its stream drained
    before it is handed over."""

    def __init__(self, inbox: "queue.Queue", outbox: "queue.Queue", watcher: "Watcher | None" = None):
        """watcher: the peer's liveness and how long a recv may wait (its alive and timeout, read
        at each recv); None waits for good (the worker's end: the target ends it with a close)."""
        self.inbox, self.outbox, self.watcher = inbox, outbox, watcher
        self.limits = Limits()

    @classmethod
    def pair(cls, watcher: "Watcher") -> tuple["QueueChannel", "QueueChannel"]:
        """(the target's end, watched by `watcher`; the worker's end)."""
        a, b = queue.Queue(), queue.Queue()
        return cls(a, b, watcher), cls(b, a)

    def send(self, msg: dict, floats: torch.Tensor | None = None) -> None:
        if floats is not None and floats.is_cuda:
            torch.cuda.current_stream(floats.device).synchronize()
        self.outbox.put((json.dumps(msg), floats))

    def recv(self) -> tuple[dict, torch.Tensor | None]:
        w = self.watcher
        deadline = time.monotonic() + (w.timeout if w is not None else float("inf"))
        while True:
            try:
                body, floats = self.inbox.get(timeout=0.05)
                return json.loads(body), floats
            except queue.Empty:
                if w is not None and not w.alive():
                    raise LinkError(f"{w.peer} died") from None
                if time.monotonic() > deadline:
                    raise LinkError(f"{w.peer} did not answer within {w.timeout:.0f} s") from None


DRAFT_PARAMS = ("temperature", "top_k", "top_p", "seed", "cache_salt")  # what drafting needs of a request


def params_to_wire(p: SamplingParams) -> dict:
    return {name: getattr(p, name) for name in DRAFT_PARAMS}


def encode_requests(requests: list[SpecRequest], release: list[int]) -> dict:
    return {"type": "step", "release": release,
            "requests": [[r.seq_id, r.num_valid, r.new_tokens, r.k,
                          None if r.params is None else params_to_wire(r.params)] for r in requests]}


def decode_requests(msg: dict) -> tuple[list[SpecRequest], list[int]]:
    try:
        requests = [SpecRequest(int(i), int(n), [int(t) for t in new], int(k),
                                None if p is None else SamplingParams(**{name: p[name] for name in DRAFT_PARAMS}))
                    for i, n, new, k, p in msg["requests"]]
        return requests, decode_release(msg)
    except (KeyError, TypeError, ValueError) as e:  # SSDError (bad sampling values) is a ValueError
        raise LinkError(f"the target sent a malformed step: {type(e).__name__}: {e}") from None


def decode_release(msg: dict) -> list[int]:
    """The sequences a step or held message tells the worker to forget."""
    try:
        return [int(i) for i in msg["release"]]
    except (KeyError, TypeError, ValueError) as e:
        raise LinkError(f"the target sent a malformed release list: {type(e).__name__}: {e}") from None


def encode_replies(replies: list[Proposal]) -> tuple[dict, torch.Tensor | None]:
    qs = [r.q for r in replies if r.q is not None]
    msg = {"type": "reply", "replies": [[r.tokens, r.hit, 0 if r.q is None else r.q.shape[0],
                                         r.tree_s, r.backup_s, r.idle_s] for r in replies]}
    return msg, torch.cat(qs).float() if qs else None


def decode_replies(msg: dict, floats: torch.Tensor | None, vocab: int, requests: list[SpecRequest]
                   ) -> list[Proposal]:
    """The worker's replies, checked against what was asked: one per request, at most k
    tokens each, ids inside the vocabulary, and exactly the q rows they announce."""
    try:
        replies = msg["replies"]
        if len(replies) != len(requests):
            raise ValueError(f"{len(replies)} replies to {len(requests)} requests")
        rows = 0 if floats is None else floats.numel() // vocab
        if floats is not None and floats.numel() != rows * vocab:
            raise ValueError(f"{floats.numel()} floats are not rows of {vocab}")
        out, start = [], 0
        for (tokens, hit, n, tree_s, backup_s, idle_s), req in zip(replies, requests):
            tokens = [int(t) for t in tokens]
            if len(tokens) > req.k or not all(0 <= t < vocab for t in tokens) or n not in (0, len(tokens)):
                raise ValueError(f"a reply of {len(tokens)} tokens and {n} q rows to a request for {req.k}")
            q = floats.view(-1, vocab)[start:start + n] if n else None
            start += n
            out.append(Proposal(tokens, q, None if hit is None else bool(hit),
                                float(tree_s), float(backup_s), float(idle_s)))
        if start != rows:
            raise ValueError(f"{rows} q rows sent, {start} announced")
        return out
    except (KeyError, TypeError, ValueError) as e:
        raise LinkError(f"the draft worker sent a malformed reply: {e}") from None
