"""Shared by the CPU kernel tests."""
import threading

import pytest
import torch


def kernel_op(get, what: str):
    """get(): a CPU kernel for this machine's default build, after starting the other runnable
    builds alongside (a cold CI machine compiles them all). Fails rather than skips when the
    default build does not compile: a missing build would silently cost the engine its speed
    (the plain-torch fallbacks are batch-invariant, but many times slower)."""
    from ssd.kernels import build
    if build.default_variant() is None:
        pytest.skip("SSD_CPU_KERNELS=off")
    for v in build.runnable_variants():
        if v != build.default_variant():
            threading.Thread(target=get, args=(v,), daemon=True).start()
    op = get()
    assert op, f"the CPU {what} kernel did not build (see stderr)"
    return op


def assert_same_bits_on_any_thread_count(compute) -> None:
    """compute() -> tensors: bit-identical with 1, 2 and 3 threads (use the `threads`
    fixture, which restores the count)."""
    runs = []
    for n in (1, 2, 3):
        torch.set_num_threads(n)
        runs.append(compute())
    assert all(torch.equal(a, b) for other in runs[1:] for a, b in zip(runs[0], other))


def runnable_builds() -> list[str]:
    """Every build this CPU runs, for comparing their bits; skips when only one runs."""
    from ssd.kernels import build
    variants = build.runnable_variants()
    if len(variants) < 2:
        pytest.skip("only the portable build runs here")
    return variants
