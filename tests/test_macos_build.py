"""The kernels as a Mac builds them, checked from Linux: every kernel source, in both aarch64
builds (dotprod, neon), compiled for aarch64-macos by zig's clang (the `ziglang` wheel) with the
flags the engine passes on macOS, against the headers of the pinned torch's macOS arm64 wheel;
the dot-product instructions where the build asks for them and nowhere else; and the library
linked against that wheel's dylibs with every symbol found. What it cannot say: that Apple clang
itself agrees (zig's clang is upstream LLVM), how fast it runs, or that Apple's libc++ loads it
(zig links its own). The choices made for Darwin (no OpenMP, sysctl's dot-product key) are
tested by faking the platform.

Marker `macos` (downloads about 210 MB once into the engine's cache, then a few minutes of
compiling on 2 cores): `python -m pytest -m macos tests/test_macos_build.py`.
"""
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import ssd.kernels.attention_cpu  # noqa: F401  (each kernel module registers its CppKernel)
import ssd.kernels.decoder_cpu  # noqa: F401
import ssd.kernels.fused_cpu  # noqa: F401
import ssd.kernels.linear_cpu  # noqa: F401
import ssd.kernels.linear_int8_cpu  # noqa: F401
import ssd.kernels.quant_cpu  # noqa: F401
from ssd.kernels import build

# zig's clang wants the CPU named: its default for aarch64-macos is apple_m1, which has the
# dot product, so the plain NEON build names the generic CPU (no dot product) explicitly.
ZIG_CPU = {"-march=armv8.2-a+dotprod": "-mcpu=generic+dotprod", "-march=armv8-a": "-mcpu=generic"}
DOT = re.compile(r"^\s*[su]dot[.\s]", re.M)  # (Apple syntax: sdot.4s v0, v1, v2)
USES_DOT = {"quant"}  # the kernels whose dotprod build multiplies with SDOT / UDOT


def test_darwin_builds_without_openmp_and_with_the_dot_product_flag():
    kernel = next(k for k in build.KERNELS if k.name == "quant")
    mac, linux = kernel.flags("dotprod", system="darwin"), kernel.flags("dotprod", system="linux")
    assert "-fopenmp" not in mac and "-fopenmp" in linux
    assert "-march=armv8.2-a+dotprod" in mac and "-march=armv8-a" in kernel.flags("neon", system="darwin")


@pytest.mark.parametrize("answer, flags", [("1", {"asimd", "asimddp"}), ("0", {"asimd"}), ("", {"asimd"}),
                                           ("garbage", {"asimd"})])
def test_macos_reads_the_dot_product_from_sysctl(answer, flags):
    """"" is what a macOS without the key answers (sysctl -n prints nothing, or fails)."""
    asked = []
    assert build._arm_flags("darwin", lambda key: asked.append(key) or answer) == flags
    assert asked == ["hw.optional.arm.FEAT_DotProd"]


def _cache() -> Path:
    return Path(os.environ.get("SSD_HOME") or Path.home() / ".cache" / "ssd-engine").expanduser() / "macos-check"


def _fetch(what: list[str], into: Path) -> Path:
    """A wheel from the package index (pip download), unpacked into `into` once."""
    if not into.is_dir():
        wheels = into.with_name(into.name + "-wheel")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), *what],
                       check=True)
        (wheel,) = wheels.glob("*.whl")
        with zipfile.ZipFile(wheel) as z:
            z.extractall(into.with_name(into.name + ".tmp"))
        into.with_name(into.name + ".tmp").rename(into)
        wheel.unlink()
    return into


@pytest.fixture(scope="module")
def toolchain() -> tuple[Path, Path]:
    """zig, and the pinned torch's macOS arm64 wheel (torch >= 2.12 is tagged macosx_14_0)."""
    version = torch.__version__.split("+")[0]
    tag = "macosx_14_0_arm64" if tuple(map(int, version.split(".")[:2])) >= (2, 12) else "macosx_11_0_arm64"
    zig = _fetch(["ziglang"], _cache() / "zig") / "ziglang" / "zig"
    zig.chmod(0o755)
    wheel = _fetch(["--platform", tag, "--only-binary=:all:", f"torch=={version}"], _cache() / f"torch-{version}")
    return zig, wheel / "torch"


def _zig(zig: Path, *args: str) -> None:
    r = subprocess.run([str(zig), *args], capture_output=True, text=True)
    assert r.returncode == 0, f"zig {' '.join(args[:4])} ...:\n{r.stderr[-4000:]}"


@pytest.mark.macos
@pytest.mark.parametrize("variant", ["dotprod", "neon"])
@pytest.mark.parametrize("name", sorted(k.name for k in build.KERNELS))
def test_a_kernel_builds_for_macos_arm64(toolchain, tmp_path, name, variant):
    zig, torch_dir = toolchain
    kernel = next(k for k in build.KERNELS if k.name == name)
    flags = [ZIG_CPU.get(f, f) for f in kernel.flags(variant, system="darwin")]
    src = tmp_path / f"{name}.cpp"
    for path, text in kernel.sources.items():  # (the texts the engine's build compiles)
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    common = ["c++", "-target", "aarch64-macos", "-std=c++20", "-fPIC", "-w", *flags,
              f"-DTORCH_EXTENSION_NAME={kernel._ns(variant)}", f"-I{torch_dir / 'include'}",
              f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}"]
    _zig(zig, *common, "-S", str(src), "-o", str(tmp_path / "k.s"))
    dots = len(DOT.findall((tmp_path / "k.s").read_text(errors="replace")))
    assert (dots > 0) == (variant == "dotprod" and name in USES_DOT), f"{dots} sdot/udot in the {variant} build"
    _zig(zig, "c++", "-target", "aarch64-macos", "-c", str(tmp_path / "k.s"), "-o", str(tmp_path / "k.o"))
    lib = torch_dir / "lib"
    # -undefined error: every symbol must be found (torch's own build passes dynamic_lookup).
    _zig(zig, "c++", "-target", "aarch64-macos", "-shared", str(tmp_path / "k.o"), "-o", str(tmp_path / "k.dylib"),
         f"-L{lib}", "-lc10", "-ltorch_cpu", "-ltorch", "-Wl,-undefined,error")
