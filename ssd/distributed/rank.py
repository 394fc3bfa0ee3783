"""A tensor-parallel rank's process (ranks 1..N-1; engine/tensor_parallel.py): it links with
rank 0, learns how to hold the model (Settings), loads it, checks it is rank 0's, keeps its
share, and runs rank 0's passes until told to stop. The engine starts one per rank on its own
machine, and a user by hand on another host, both as `ssd rank` (ssd/cli.py)."""
import argparse
import os
import signal
import sys
from pathlib import Path

import torch

from ssd.distributed.link import connect, die_with_parent, parse_address
from ssd.distributed.placement import engine_threads
from ssd.distributed.tensor_parallel import (RANK_SECRET_ENV, Group, RankError, Settings, fingerprint, load,
                                        local_config, report, serve)
from ssd.errors import SSDError
from ssd.runner.kv_cache import PagedKVCache
from ssd.store import resolve_model


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--connect", required=True, metavar="HOST:PORT", help="where rank 0 waits")
    ap.add_argument("--rank", type=int, required=True, help="this rank, 1..N-1")
    ap.add_argument("--world", type=int, required=True, help="N, the engine's tensor_parallel_size")
    ap.add_argument("--model", required=True, help="the same model as rank 0's: store name, hub id (org/name) or folder")
    ap.add_argument("--threads", type=int, help="CPU threads (default: all cores)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for rank 0 (default: 600)")
    ap.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN if args.parent_pid is not None else signal.SIG_DFL)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    die_with_parent(args.parent_pid)
    secret = os.environ.pop(RANK_SECRET_ENV, "")
    if not secret:
        raise SSDError(f"set {RANK_SECRET_ENV} to the secret rank 0 was given (the same value on every host)")
    if not 0 < args.rank < args.world:
        raise SSDError(f"--rank must be in 1..{args.world - 1} for --world {args.world}, got {args.rank}")
    torch.set_num_threads(engine_threads(args.threads))
    host, port = parse_address(args.connect)
    try:
        # No timeout on this side: it waits for rank 0's next pass as long as the engine idles.
        group = Group(connect(host, port, args.rank, args.timeout, secret, world=args.world), args.rank, args.world)
        settings = Settings.recv(group)
        problem, model = "", None
        try:
            folder = resolve_model(args.model)
            if fingerprint(folder) != settings.fingerprint:
                problem = f"rank {args.rank} holds another model than rank 0's ({folder})"
            else:
                dtype, cpu = getattr(torch, settings.dtype), torch.device("cpu")
                model = load(Path(folder), cpu, dtype, settings.weights, group)
                kv = PagedKVCache(local_config(model), settings.kv_tokens, settings.block_size, cpu, dtype).kv
        except (SSDError, OSError) as e:
            problem = f"rank {args.rank}: {e}"
        if report(group, problem)[args.rank] or model is None:
            print(f"ssd rank {args.rank}: {problem}", file=sys.stderr)
            return 2
        serve(model, kv, group)
    except (RankError, RuntimeError) as e:  # rank 0 or another rank went away, or a bad secret
        print(f"ssd rank {args.rank}: the link closed ({str(e).splitlines()[0]})", file=sys.stderr)
        return 1
    return 0


def exit_now(code: int) -> None:
    """End the process with `code` at once: tearing gloo's process group down at interpreter
    exit can abort it ("terminate called without an active exception") after its work is done."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
