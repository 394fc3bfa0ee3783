"""The SSD draft worker: a process of its own, pinned to its own CPU cores or on its own GPU,
that answers the target's speculation requests and, while the target verifies, builds the
speculation cache for the next round (ssd/spec/draft_engine.py).

The target starts it (`LLM(..., mode="ssd")`); for a draft on another host, start it there
by hand and point it at the target, which waits at `LLM(..., draft_address="HOST:PORT")`:

    ssd worker --connect TARGET_HOST:PORT [--device cpu:1 | cuda:0]
"""
import argparse
import os
import signal
import sys
import time

import torch

from ssd.engine.placement import Placement, parse_placement, pin
from ssd.errors import SSDError
from ssd.models.loader import load_model
from ssd.spec.draft_engine import DraftEngine
from ssd.spec.fanout import FanOut
from ssd.spec.protocol import TARGET, WORKER, Channel, connect, decode_requests, encode_replies, parse_address
from ssd.store import resolve_model

def build_engine(hello: dict, device: torch.device) -> DraftEngine:
    """The draft engine the target's hello message describes."""
    folder = resolve_model(hello["model"])
    dtype = getattr(torch, hello["dtype"])  # "float32", "bfloat16", ... as the target names it
    model = load_model(folder, device, dtype, quantize=hello.get("quantization"))
    k = hello["k"]
    return DraftEngine(model, device, k=k, cache_tokens=hello["cache_tokens"], block_size=hello["block_size"],
                       fan_out=FanOut(k, hello["fan_out"], hello.get("fan_out_miss"), hello.get("tree_budget")),
                       backup=hello["backup"], saguaro_c=hello.get("saguaro_c"), seed=hello.get("seed"))


def serve(channel: Channel, device: torch.device) -> None:
    hello, _ = channel.recv()
    try:
        engine = build_engine(hello, device)
    except (SSDError, OSError, RuntimeError) as e:
        channel.send({"type": "error", "message": f"{type(e).__name__}: {e}"})
        return
    channel.send({"type": "ready", "vocab_size": engine.vocab, "pid": os.getpid()})
    timings: dict = {}
    idle_from = time.perf_counter()
    with torch.inference_mode():
        while True:
            msg, _ = channel.recv()
            start = time.perf_counter()
            if msg["type"] == "close":
                return
            requests, release = decode_requests(msg)
            engine.release(release)
            replies = engine.step(requests)
            # This step's backup time; the previous build's tree time and the idle wait since.
            timings.update(backup_s=time.perf_counter() - start, idle_s=start - idle_from)
            channel.send(*encode_replies(replies, timings))
            stats = engine.build()  # overlaps the target's verification of `replies`
            timings = {"tree_s": stats.seconds, "branches": stats.branches}
            idle_from = time.perf_counter()


def _die_with_parent(parent_pid: int | None) -> None:
    """Linux: the kernel sends SIGTERM when the parent dies, so no worker is left behind."""
    if parent_pid is None or not sys.platform.startswith("linux"):
        return
    import ctypes
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        sys.exit(0)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--connect", required=True, metavar="HOST:PORT",
                    help="the address the target waits at (LLM(..., draft_address=HOST:PORT))")
    ap.add_argument("--device", default="cpu", help="cpu, cpu:CORES (e.g. cpu:1, cpu:2-3) or cuda:N (default: cpu)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the target (default: 600)")
    ap.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    # Ctrl-C in a terminal reaches the whole process group; the target decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    _die_with_parent(args.parent_pid)
    place: Placement = parse_placement(args.device)
    host, port = parse_address(args.connect)
    pin(place.cores)
    if place.device.type == "cuda":
        torch.cuda.set_device(place.device)
    try:
        pg = connect(host, port, WORKER, args.timeout)
        serve(Channel(pg, TARGET, place.device if pg.name() == "nccl" else torch.device("cpu")), place.device)
    except RuntimeError as e:  # the target went away: nothing left to serve
        print(f"ssd worker: the link to the target closed ({str(e).splitlines()[0]})", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ssd worker", description="Run an SSD draft worker for a target.")
    add_arguments(ap)
    try:
        return run(ap.parse_args(argv))
    except SSDError as e:
        print(f"ssd worker: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
