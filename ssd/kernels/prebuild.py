"""Every CPU kernel built at once: a model on the CPU needs most of them in its first pass,
and one at a time their compilers ran for minutes on a fresh machine where side by side they
take about as long as the slowest one (each build is a compiler process of its own)."""
from concurrent.futures import ThreadPoolExecutor

# Each module creates its kernel (build.KERNELS) on import; nothing compiles until build().
from ssd.kernels import attention_cpu, decoder_cpu, fused_cpu, linear_cpu, linear_int8_cpu, quant_cpu  # noqa: F401
from ssd.kernels.build import KERNELS, default_variant


def prebuild() -> None:
    """Build or load this machine's variant of every kernel, in parallel; a kernel that cannot
    build says so once and its callers fall back, as at first use."""
    if default_variant() is None:
        return
    with ThreadPoolExecutor(len(KERNELS), thread_name_prefix="ssd-kernel-build") as pool:
        list(pool.map(lambda kernel: kernel.build(), KERNELS))
