"""The SSD draft worker: a process of its own, pinned to its own CPU cores or on its own GPU,
that answers the target's speculation requests and, while the target verifies, builds the
speculation cache for the next round (ssd/speculative/draft/ssd_draft.py).

The target starts it (`LLM(..., mode="ssd")`), in a session of its own, with the run's
secret in its environment. For a draft on another host, start it there by hand with the
secret the target was given, and point it at the target, which waits at
`LLM(..., draft_address="HOST:PORT")`:

    SSD_DRAFT_SECRET=... ssd worker --connect TARGET_HOST:PORT [--device cpu:1 | cuda:0]
"""
import argparse
import os
import signal
import sys
import time
from contextlib import nullcontext

import torch

from ssd.distributed.link import TARGET, WORKER, LinkError, connect, die_with_parent, parse_address
from ssd.distributed.placement import Placement, parse_placement, pin
from ssd.errors import SSDError
from ssd.speculative.draft.ssd_draft import SSDDraft
from ssd.speculative.link.protocol import (Channel, Limits, QueueChannel, decode_release, decode_requests,
                                      encode_replies)
from ssd.speculative.options import SECRET_ENV, DraftConfig


def serve(channel: Channel | QueueChannel, device: torch.device) -> None:
    hello, _ = channel.recv()
    try:
        if hello["type"] != "hello":
            raise SSDError(f"expected a hello message, got {hello['type']!r}")
        config = DraftConfig.from_dict(hello.get("config"))
        draft = SSDDraft.from_config(config, device)
    except (SSDError, OSError, RuntimeError, TypeError) as e:
        channel.send({"type": "error", "message": f"{type(e).__name__}: {e}"})
        return
    channel.limits = Limits.for_config(config.max_num_seqs, config.max_model_len, config.k_max, draft.engine.head.vocab)
    channel.send({"type": "ready", "vocab_size": draft.engine.head.vocab, "pid": os.getpid()})
    tree_shares: dict[int, float] = {}
    idle_from = time.perf_counter()
    with torch.inference_mode():
        while True:
            msg, _ = channel.recv()
            start = time.perf_counter()
            if msg["type"] == "close":
                return
            if msg["type"] == "held":  # between rounds: not a request the build is timed against
                for seq_id in decode_release(msg):
                    draft.release(seq_id)
                channel.send({"type": "held", "held": draft.held()})
                continue
            requests, release = decode_requests(msg)
            draft.fit_tree_to(start - idle_from)
            for seq_id in release:
                draft.release(seq_id)
            try:
                replies = draft.step(requests)
            except SSDError as e:  # the target broke the protocol
                channel.send({"type": "error", "message": str(e)})
                return
            for r, reply in zip(requests, replies):
                # A sequence's first request: the time before it was not spent on it.
                reply.tree_s = tree_shares.get(r.seq_id, 0.0)
                reply.idle_s = 0.0 if r.params is not None else start - idle_from
            channel.send(*encode_replies(replies))
            tree_shares = draft.build()  # overlaps the target's verification of `replies`
            idle_from = time.perf_counter()


def serve_in_thread(channel: QueueChannel, device: torch.device) -> None:
    """serve() as a thread of the target's process (SpecOptions.draft_thread): on a CUDA device,
    on a stream of its own, so its kernels can run beside the target's."""
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        try:
            serve(channel, device)
        except LinkError:  # the target went away
            pass


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--connect", required=True, metavar="HOST:PORT",
                    help="the address the target waits at (LLM(..., draft_address=HOST:PORT))")
    ap.add_argument("--device", default="cpu", help="cpu, cpu:CORES (e.g. cpu:1, cpu:2-3) or cuda:N (default: cpu)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the target (default: 600)")
    ap.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.parent_pid is not None:
        # Started by a target: it decides when we stop (a stray SIGINT is not ours to act on).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    die_with_parent(args.parent_pid)
    secret = os.environ.pop(SECRET_ENV, "")
    if not secret:
        raise SSDError(f"set {SECRET_ENV} to the secret the target was given (the same value on both hosts)")
    place: Placement = parse_placement(args.device)
    host, port = parse_address(args.connect)
    pin(place.cores)
    if place.device.type == "cuda":
        torch.cuda.set_device(place.device)
    try:
        pg = connect(host, port, WORKER, args.timeout, secret)
        serve(Channel(pg, TARGET, place.device if pg.name() == "nccl" else torch.device("cpu")), place.device)
    except RuntimeError as e:  # the target went away, or is not who it should be (LinkError)
        print(f"ssd worker: the link to the target closed ({str(e).splitlines()[0]})", file=sys.stderr)
        return 1
    return 0

