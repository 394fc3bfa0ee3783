"""A machine doing other things, for `ssd bench --busy-cores N`: N processes that each spin on
a core while a configuration runs (docs/kernels.md, "A busy machine")."""
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

SPIN = "while True: pass"
START_S = 0.2  # long enough for the interpreters to start spinning


@contextmanager
def busy(cores: int) -> Iterator[None]:
    """Run the body with `cores` busy loops beside it (none for 0)."""
    loops = [subprocess.Popen([sys.executable, "-S", "-c", SPIN]) for _ in range(cores)]
    try:
        if loops:
            time.sleep(START_S)
        yield
    finally:
        for p in loops:
            p.kill()
        for p in loops:
            p.wait()
