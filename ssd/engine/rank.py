"""A tensor-parallel rank's process (ranks 1..N-1; engine/tensor_parallel.py): it links with
rank 0, loads the model, keeps its share, and runs rank 0's passes until told to stop."""
import argparse
import os
import signal
import sys
from pathlib import Path

import torch

from ssd.engine.kv_cache import PagedKVCache
from ssd.engine.tensor_parallel import Group, local_config, serve, shard
from ssd.errors import RankError
from ssd.models.loader import load_model
from ssd.speculative.options import SECRET_ENV
from ssd.speculative.protocol import connect, die_with_parent, parse_address


def main(argv: list[str] | None = None) -> int:
    """A tensor-parallel rank 1..N-1 (tensor_parallel.Ranks starts it)."""
    ap = argparse.ArgumentParser(prog="python -m ssd.engine.rank", description=main.__doc__)
    ap.add_argument("--connect", required=True, metavar="HOST:PORT")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--weights", default="dequantized")
    ap.add_argument("--kv-tokens", type=int, required=True)
    ap.add_argument("--block-size", type=int, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--parent-pid", type=int)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when a rank stops
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    die_with_parent(args.parent_pid)
    secret = os.environ.pop(SECRET_ENV, "")
    torch.set_num_threads(args.threads)
    host, port = parse_address(args.connect)
    group = Group(connect(host, port, args.rank, args.timeout, secret, world=args.world), args.rank, args.world)
    dtype, cpu = getattr(torch, args.dtype), torch.device("cpu")
    model = shard(load_model(args.model, cpu, dtype, args.weights), group)
    kv = PagedKVCache(local_config(model), args.kv_tokens, args.block_size, cpu, dtype).kv
    try:
        serve(model, kv, group)
    except RankError as e:  # rank 0 or another rank went away
        print(f"ssd tensor-parallel rank {args.rank}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    # Not sys.exit: tearing gloo's process group down at interpreter exit can abort the process
    # ("terminate called without an active exception") after its work is done.
    os._exit(code)
