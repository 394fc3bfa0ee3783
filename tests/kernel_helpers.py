"""Shared by the CPU kernel tests."""
import threading

import pytest


def kernel_op(get, what: str):
    """get(): a CPU kernel for this machine's default build, after starting the other runnable
    builds alongside (a cold CI machine compiles them all). Fails rather than skips when the
    default build does not compile: a missing build would silently cost the engine its
    exactness (the fallbacks are not batch-invariant)."""
    from ssd.kernels import build
    if build.default_variant() is None:
        pytest.skip("SSD_CPU_KERNELS=off")
    for v in build.runnable_variants():
        if v != build.default_variant():
            threading.Thread(target=get, args=(v,), daemon=True).start()
    op = get()
    assert op, f"the CPU {what} kernel did not build (see stderr)"
    return op
