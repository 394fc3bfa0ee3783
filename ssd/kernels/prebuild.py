"""Every CPU kernel built at once: a model on the CPU needs most of them in its first pass,
and one at a time their compilers ran for minutes on a fresh machine where side by side they
take about as long as the slowest one. Each kernel not yet built compiles in a process of its
own (torch aborts when threads of one process load extensions at once); this process loads
each at its first use, as before (a library loaded twice under one namespace aborts too).

    python -m ssd.kernels.prebuild NAME   # build one kernel (what prebuild() starts)
"""
import subprocess
import sys

# Each module creates its kernel (build.KERNELS) on import; nothing compiles until build().
from ssd.kernels import attention_cpu, decoder_cpu, fused_cpu, linear_cpu, linear_int8_cpu, quant_cpu  # noqa: F401
from ssd.kernels import build


def prebuild() -> None:
    """Compile this machine's variant of every kernel not yet built, side by side; a kernel
    that cannot build says so at its first use and its callers fall back."""
    if build.default_variant() is None:
        return
    missing = {k.name for k in build.KERNELS if not k.is_built()}
    if len(missing) > 1:
        for p in [subprocess.Popen([sys.executable, "-m", "ssd.kernels.prebuild", name]) for name in sorted(missing)]:
            p.wait()


if __name__ == "__main__":
    next(k for k in build.KERNELS if k.name == sys.argv[1]).build()
