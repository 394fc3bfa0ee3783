"""Where a model runs: a torch device and, on the CPU, the cores its process is pinned to.

Written like a torch device with an optional core list for the CPU: "cpu" (all cores),
"cpu:1", "cpu:0-3", "cpu:0,2"; "cuda", "cuda:1".
"""
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ssd.errors import SSDError


@dataclass(frozen=True)
class Placement:
    device: torch.device
    cores: tuple[int, ...] | None = None  # CPU cores to pin to; None: as the process already is

    def __str__(self) -> str:
        if self.cores is None:
            return str(self.device)
        return f"cpu:{','.join(map(str, self.cores))}"


def default_dtype(device: torch.device) -> torch.dtype:
    """What a device computes in unless told otherwise: bf16 on a GPU, fp32 on the CPU (whose
    kernels take fp32 activations)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def parse_placement(spec: str | torch.device) -> Placement:
    text = str(spec).strip().lower()
    kind, _, rest = text.partition(":")
    if kind == "cuda":
        try:
            device = torch.device(text)
        except RuntimeError as e:
            raise SSDError(f"bad device {spec!r}: {e}") from e
        if not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count():
            raise SSDError(f"device {spec!r} was asked for but this machine has "
                           f"{torch.cuda.device_count() if torch.cuda.is_available() else 'no usable'} CUDA GPUs")
        return Placement(device)
    if kind != "cpu":
        raise SSDError(f"bad device {spec!r}: expected cpu, cpu:CORES (e.g. cpu:1, cpu:0-3, cpu:0,2) or cuda[:N]")
    if not rest:
        return Placement(torch.device("cpu"))
    cores: list[int] = []
    try:
        for part in rest.split(","):
            lo, _, hi = part.partition("-")
            cores += range(int(lo), int(hi or lo) + 1)
    except ValueError:
        raise SSDError(f"bad CPU core list in {spec!r}: expected e.g. cpu:1, cpu:0-3 or cpu:0,2") from None
    missing = sorted(set(cores) - set(available_cores()))
    if not cores or missing:
        raise SSDError(f"device {spec!r}: cores {missing or cores} are not available here "
                       f"(this process may use cores {available_cores()})")
    return Placement(torch.device("cpu"), tuple(sorted(set(cores))))


def default_pair(device: torch.device) -> tuple[Placement, Placement]:
    """SSD's default split: on the CPU, the first half of the cores for the target and the
    rest for the draft (core 0 and core 1 on a 2-core machine); on CUDA, GPU 0 and GPU 1
    (the same GPU when there is only one)."""
    if device.type == "cuda":
        other = 1 if torch.cuda.device_count() > 1 else 0
        return Placement(torch.device("cuda", 0)), Placement(torch.device("cuda", other))
    cores = available_cores()
    if len(cores) < 2:
        return Placement(device), Placement(device)
    half = len(cores) // 2
    return Placement(device, tuple(cores[:half])), Placement(device, tuple(cores[half:]))


def beside_gpu(draft: Placement, target: torch.device) -> Placement:
    """A draft on "cpu" (no cores named) beside a target on a GPU: every core but the first,
    which the target's host thread keeps (it launches the GPU's work and reads its results;
    a parallel region of the draft's that shared its core would wait on its slowest thread)."""
    cores = available_cores()
    if draft.device.type != "cpu" or draft.cores is not None or target.type != "cuda" or len(cores) < 2:
        return draft
    return Placement(draft.device, tuple(cores[1:]))


def engine_threads(threads: int | None = None, cores: tuple[int, ...] | None = None) -> int:
    """The one rule for how many CPU threads the engine computes with: `threads` if given,
    else one per core of `cores` (a placement's), else one per core this process may use.
    Benchmark peers get the same number."""
    if threads is not None:
        return threads
    return len(cores) if cores else len(available_cores())


def pin(cores: tuple[int, ...] | None) -> None:
    """Pin this process to `cores` and give torch one thread per core."""
    if cores is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))


@contextmanager
def pinned(cores: tuple[int, ...] | None) -> Iterator[None]:
    """Run the body pinned to `cores`, then restore the process's cores and thread count."""
    if cores is None or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    pin(cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)
