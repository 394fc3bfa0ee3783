"""Just-in-time builds of the C++ CPU kernels, one per ISA variant.

Each kernel's source is compiled on first use (never at import) with
``torch.utils.cpp_extension`` into ``$SSD_HOME/kernels`` (default
``~/.cache/ssd-engine/kernels``), once per machine, source (with the csrc/ headers it
includes), compiler flags and torch version, for the best ISA the CPU has: on x86-64
``avx512`` or ``avx2`` (AVX2 + FMA), on aarch64 ``dotprod`` (NEON with the dot-product
extension) or ``neon``, anywhere ``portable`` (plain C++, NEON off). Every build gives the
same bits (docs/kernels.md). The aarch64 CPU's features come from the kernel's hardware
capabilities (/proc/self/auxv, which qemu-user emulates too) on Linux and from ``sysctl`` on
macOS, where Apple clang builds without ``-fopenmp`` (the kernels parallelise through torch).

If no build is possible (no C++ compiler, ``SSD_CPU_KERNELS=off``) the kernel reports itself
unavailable, after one line on stderr for a failed build, and callers compute in plain torch
one row at a time (ssd/kernels/fallback.py): slower, still batch-invariant, so SD and SSD
still equal AR. GGUF blocks have no such fallback: a model on them is loaded dequantised
instead (ssd/models/loader.py).

``SSD_CPU_KERNELS``: ``auto`` (default), one of VARIANTS, or ``off``.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import platform
import posixpath
import re
import struct
import subprocess
import sys
import threading
from pathlib import Path

import torch

VARIANTS = ("avx512", "avx2", "dotprod", "neon", "portable")
_ISA_FLAGS = {"avx512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512dq"],
              "avx2": ["-mavx2", "-mfma"], "dotprod": ["-march=armv8.2-a+dotprod"], "neon": ["-march=armv8-a"],
              "portable": ["-DSSD_PORTABLE=1"]}
# The CPU flags each build needs, in /proc/cpuinfo's names (x86) or the kernel's HWCAP names
# (aarch64: every aarch64 CPU has "asimd", NEON; "asimddp" is the dot-product extension).
_CPU_FLAGS = {"avx512": {"avx2", "fma", "avx512f", "avx512dq"}, "avx2": {"avx2", "fma"},
              "dotprod": {"asimd", "asimddp"}, "neon": {"asimd"}, "portable": set()}

def _openmp(system: str = sys.platform) -> tuple[str, ...]:
    """-fopenmp, but not on macOS: Apple clang has none (the kernels need none)."""
    return () if system == "darwin" else ("-fopenmp",)


_AT_HWCAP, _HWCAP_ASIMD, _HWCAP_ASIMDDP = 16, 1 << 1, 1 << 20  # Linux aarch64 (asm/hwcap.h)
_MISSING = object()


@functools.cache
def _cpuinfo(key: str) -> str | None:
    """The first value of `key` ("flags", "vendor_id") in /proc/cpuinfo; None without one."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == key:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _sysctl(name: str) -> str:
    """macOS's value of a sysctl key, "" where it has none (or sysctl cannot be run)."""
    try:
        return subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _arm_flags(system: str = sys.platform, sysctl=_sysctl) -> frozenset[str]:
    """An aarch64 CPU's features that the builds need: macOS says them through sysctl
    (hw.optional.arm.FEAT_DotProd is 1 on every Apple M chip; missing on an older macOS, where
    NEON alone is assumed); Linux through the auxiliary vector's HWCAP (the program's view of
    the CPU, also under qemu-user, whose /proc/cpuinfo is the host's)."""
    if system == "darwin":
        return frozenset({"asimd", "asimddp"} if sysctl("hw.optional.arm.FEAT_DotProd") == "1" else {"asimd"})
    try:
        raw = Path("/proc/self/auxv").read_bytes()
    except OSError:
        return frozenset({"asimd"})  # NEON is part of every aarch64 CPU
    pairs = dict(struct.iter_unpack("<QQ", raw[:len(raw) // 16 * 16]))
    hwcap = pairs.get(_AT_HWCAP, _HWCAP_ASIMD)
    return frozenset(name for name, bit in (("asimd", _HWCAP_ASIMD), ("asimddp", _HWCAP_ASIMDDP)) if hwcap & bit)


def cpu_has(*flags: str) -> bool:
    """Whether this CPU has all these features (/proc/cpuinfo's names on x86)."""
    return set(flags) <= _cpu_flags()


@functools.cache
def _cpu_flags() -> frozenset[str]:
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return _arm_flags()
    if machine not in ("x86_64", "amd64"):
        return frozenset()
    flags = _cpuinfo("flags")
    if flags is not None:
        return frozenset(flags.split())
    cap = torch.backends.cpu.get_cpu_capability()  # no /proc (macOS, Windows)
    return frozenset(_CPU_FLAGS.get(cap.lower(), set()))


def stream_tuning() -> list[str]:
    """How the quantised matmul streams its weights, per CPU vendor (compiler defines; timing
    only: the results' bits do not depend on them). Intel: prefetch 2048 bytes ahead into L1,
    four groups of rows side by side for a single row of x. AMD: 8192 bytes ahead into L2 only,
    one sequential stream per thread (docs/decision-log.md, "Weight streaming")."""
    if _cpuinfo("vendor_id") == "AuthenticAMD":
        return ["-DSSD_PF_BYTES=8192", "-DSSD_PF_L2=1", "-DSSD_M1_STREAMS=1"]
    return ["-DSSD_PF_BYTES=2048", "-DSSD_PF_L2=0", "-DSSD_M1_STREAMS=4"]


@functools.cache
def runnable_variants() -> tuple[str, ...]:
    """The builds this CPU can run, fastest first."""
    return tuple(v for v in VARIANTS if _CPU_FLAGS[v] <= _cpu_flags())


@functools.cache
def default_variant() -> str | None:
    """The build this machine uses (the first runnable of VARIANTS), or None if switched
    off by ``SSD_CPU_KERNELS`` (read once: ``default_variant.cache_clear()`` re-reads it)."""
    env = os.environ.get("SSD_CPU_KERNELS", "auto").strip().lower()
    if env in ("0", "off", "false", "no", "none"):
        return None
    if env in runnable_variants():
        return env
    return runnable_variants()[0]  # "auto", or an ISA this CPU lacks


SOURCES = Path(__file__).with_name("csrc")
_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


KERNELS: list["CppKernel"] = []  # every kernel, as its module creates it


class CppKernel:
    """One C++ source, ``csrc/<name>.cpp``, defining ops in the torch library namespace
    ``SSD_NS`` (a macro set per variant), built lazily per variant; ``op(name)`` returns the
    op or None if unavailable."""

    def __init__(self, name: str, requires: dict[str, tuple[set[str], list[str]]] | None = None):
        """requires: per variant, the CPU flags this kernel needs beyond the variant's own and
        the compiler flags that enable them (a machine without them runs a lower variant)."""
        KERNELS.append(self)
        self.name = name
        self.requires = requires or {}
        self._locks = {v: threading.Lock() for v in VARIANTS}  # variants may build concurrently
        self._built: dict[str, str | None] = {}  # variant -> torch.ops namespace, or None
        # (variant, op name) -> op: a model calls op() for every layer of every pass, and
        # resolving it anew cost ~12 us a call (5 % of a 0.5B draft's step).
        self._ops: dict[tuple[str, str], object] = {}
        self._warned = False

    @functools.cached_property
    def sources(self) -> dict[str, str]:
        """The text of ``csrc/<name>.cpp`` and of every header of csrc/ it includes with
        ``#include "..."`` (transitively), by path under csrc/, the .cpp first. A header is
        looked up beside the file that includes it, as the compiler looks first; one not found
        there is not ours (the compiler finds it elsewhere or fails)."""
        found: dict[str, str] = {}

        def read(path: str) -> None:
            found[path] = text = (SOURCES / path).read_text()
            for name in _LOCAL_INCLUDE.findall(text):
                header = posixpath.normpath(posixpath.join(posixpath.dirname(path), name))
                if header not in found and not header.startswith("..") and (SOURCES / header).is_file():
                    read(header)

        read(f"{self.name}.cpp")
        return found

    def flags(self, variant: str, system: str = sys.platform) -> list[str]:
        """The compiler's flags for this build on `system` (sys.platform's names)."""
        return ["-O3", *_openmp(system), "-ffp-contract=off", f"-DSSD_NS={self._ns(variant)}", *stream_tuning(),
                *_ISA_FLAGS[variant], *self.requires.get(variant, (set(), []))[1]]

    @functools.cached_property
    def _runnable(self) -> tuple[str, ...]:
        return tuple(v for v in runnable_variants() if self.requires.get(v, (set(), []))[0] <= _cpu_flags())

    def runnable(self) -> list[str]:
        """The builds of this kernel this CPU runs, fastest first."""
        return list(self._runnable)

    def variant(self) -> str | None:
        """This machine's build of this kernel: the machine's default, or the best below it
        that this kernel's extra needs allow; None if kernels are switched off."""
        default = default_variant()
        if default is None:
            return None
        return next((v for v in VARIANTS[VARIANTS.index(default):] if v in self._runnable), None)

    def _ns(self, variant: str) -> str:
        return f"ssd_{self.name}_{variant}"

    def build_dir(self, variant: str) -> Path:
        root = Path(os.environ.get("SSD_HOME") or Path.home() / ".cache" / "ssd-engine").expanduser()
        texts = [part for path, text in self.sources.items() for part in (path, text)]
        tag = hashlib.sha256("\0".join([*texts, *self.flags(variant), torch.__version__])
                             .encode()).hexdigest()[:12]
        return root / "kernels" / f"{self.name}-{variant}-{tag}"

    def _build(self, variant: str) -> str:
        from torch.utils import cpp_extension

        ns, d = self._ns(variant), self.build_dir(variant)
        d.mkdir(parents=True, exist_ok=True)
        # The headers go beside the source, as in csrc/: the compiler reads exactly the texts
        # that build_dir hashed (an include path to csrc/ would read whatever is there now).
        for path, text in self.sources.items():
            dest = d / path
            if not dest.exists() or dest.read_text() != text:
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_text(text)
        src = d / f"{self.name}.cpp"
        # torch's own build lock (a file `lock` that it waits on while it exists) outlives a
        # build that was killed, and the next process would wait forever. So builds take an
        # OS lock first, which dies with its process: whoever holds it may delete `lock`.
        with open(d / "build.flock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            (d / "lock").unlink(missing_ok=True)
            if not (d / f"{ns}.so").exists():
                # one write: kernels build side by side (prebuild.py) and their lines must not mix
                sys.stderr.write(f"ssd-engine: compiling the CPU {self.name} kernel ({variant}) into {d} "
                                 "(once per machine and version)\n")
                sys.stderr.flush()
            # Lists of their own: load() appends torch's libraries to extra_ldflags in place, and
            # a shared list would change every later kernel's flags, so its hash (a rebuild).
            cpp_extension.load(name=ns, sources=[str(src)], extra_cflags=self.flags(variant),
                               extra_ldflags=list(_openmp()), build_directory=str(d),
                               is_python_module=False, verbose=False)
        return ns

    def op(self, op_name: str, variant: str | None = None):
        """The compiled op for a variant (default: this machine's), building it on first
        use; None if it cannot be built or is switched off. Never raises for a build error."""
        variant = variant or self.variant()
        if variant is None:
            return None
        op = self._ops.get((variant, op_name))
        if op is not None:
            return op
        ns = self.op_namespace(variant)
        if ns is None:
            return None
        op = self._ops[variant, op_name] = getattr(getattr(torch.ops, ns), op_name)
        return op

    def op_namespace(self, variant: str) -> str | None:
        """The torch.ops namespace of a variant's build, building it on first use; None if
        it cannot be built or this CPU cannot run it."""
        if variant not in VARIANTS:
            raise ValueError(f"unknown CPU kernel variant {variant!r}; known: {VARIANTS}")
        if variant not in self._runnable:  # would die on an illegal instruction
            return None
        ns = self._built.get(variant, _MISSING)
        if ns is _MISSING:
            with self._locks[variant]:
                if variant not in self._built:
                    try:
                        self._built[variant] = self._build(variant)
                    except Exception as e:  # no compiler, no ninja, read-only home, ...
                        self._built[variant] = None
                        self._warn(variant, e)
            ns = self._built[variant]
        return ns

    def is_built(self) -> bool:
        """Whether this machine's variant is compiled already (or switched off)."""
        variant = self.variant()
        return variant is None or (self.build_dir(variant) / f"{self._ns(variant)}.so").exists()

    def build(self) -> None:
        """Build (or load) this machine's variant now rather than at first use."""
        variant = self.variant()
        if variant is not None:
            self.op_namespace(variant)

    def _warn(self, variant: str, e: Exception) -> None:
        if not self._warned:
            self._warned = True
            last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
            print(f"ssd-engine: CPU {self.name} kernel ({variant}) unavailable, running without it "
                  f"(slower, still batch-invariant): {type(e).__name__}: {last}",
                  file=sys.stderr, flush=True)
