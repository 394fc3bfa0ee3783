"""What SSD with a feature head would add to each round: the accepted tokens' features carried
to the draft worker with the target's word (docs/algorithm.md, "Feature heads"). A head drafts
from the target's hidden states at three layers, so a worker that drafts the next round needs
those of every token the round accepted: (K + 1) x 3 x hidden floats a sequence, against the
few token ids a step message holds today.

Two processes over the worker's own channel (gloo, this host), the step message timed as a
round trip (target -> worker -> target) without and with the features:

    python bench/studies/head_features_link.py --hidden 1536 --k 3 --seqs 1
"""
import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ssd.speculative.link.protocol import Channel, Limits


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(rank: int, port: int, rows: int, width: int, rounds: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    channel = Channel(dist.group.WORLD, 1 - rank, torch.device("cpu"))
    channel.limits = Limits(json_bytes=1 << 20, floats=rows * width)
    step = {"type": "step", "release": [], "requests": [[0, 120, [4711], 3, None]]}
    timings = {}
    for label, floats in (("ids only", None), ("ids + features", torch.randn(rows, width))):
        took = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            if rank == 0:
                channel.send(step, floats)
                channel.recv()
            else:
                channel.recv()
                channel.send({"type": "reply", "replies": [[[1, 2, 3], True, 0, 0.0, 0.0, 0.0]]})
            took.append(time.perf_counter() - t0)
        timings[label] = statistics.median(took[rounds // 10:])
    if rank == 0:
        out.put(timings)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1536, help="the target's width (Qwen2.5 1.5B: 1536)")
    ap.add_argument("--k", type=int, default=3, help="drafted tokens a round")
    ap.add_argument("--seqs", type=int, default=1, help="sequences in a step")
    ap.add_argument("--rounds", type=int, default=500)
    args = ap.parse_args()
    rows, width = args.seqs * (args.k + 1), 3 * args.hidden
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    out = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_run, args=(_free_port(), rows, width, args.rounds, out), nprocs=2)
    timings = out.get()
    print(f"features a step: {rows} rows x {width} floats = {rows * width * 4 / 1024:.0f} KiB")
    for label, s in timings.items():
        print(f"{label:>16}: {s * 1e3:.3f} ms a round trip")
    print(f"added: {(timings['ids + features'] - timings['ids only']) * 1e3:.3f} ms a round")


if __name__ == "__main__":
    main()
