"""aarch64 under emulation (`python -m pytest -m arm`): an arm64 Debian root run by
qemu-user-static (tests/arm_root.sh, built on first use under SSD_ARM_ROOT, default
$SSD_HOME/arm64) runs the kernel tests there, where the builds are NEON with the dot-product
extension, NEON without it and portable: their bits against each other, against this x86
machine's builds on the same inputs (tests/kernel_bits.py), batch invariance; and greedy SD
and prompt lookup equal to AR on SmolLM2 end to end. Needs root (chroot and bind mounts).
Emulation runs the code, not its speed: no timing here means anything."""
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from kernel_bits import outputs
from ssd.kernels import build
from ssd.store import store_root

pytestmark = pytest.mark.arm

REPO = Path(__file__).resolve().parents[1]
INSIDE = ["tests/test_kernel_bits.py", "tests/test_quant_kernel.py", "tests/test_linear_kernel.py",
          "tests/test_int8.py", "tests/test_attention_kernel.py", "tests/test_fused_kernel.py",
          "tests/test_kernel_build.py", "tests/test_sd.py::test_greedy_sd_equals_ar",
          "tests/test_ngram.py::test_ngram_greedy_equals_ar_and_accepts_repeats"]
HOURS = 3  # the first run compiles every kernel three times under emulation


@contextmanager
def mounted(root: Path, models: Path) -> Iterator[None]:
    """/proc, /sys (read-only), the repository at /repo and the host's models (the store's
    folder) under the root's SSD_HOME."""
    mounts = [(["-t", "proc", "proc"], root / "proc"), (["--bind", "-o", "ro", "/sys"], root / "sys"),
              (["--bind", str(REPO)], root / "repo"),
              (["--bind", str(models)], root / "ssd-home" / "models")]  # the store may prepare a model in place
    done = []
    try:
        for how, where in mounts:
            where.mkdir(parents=True, exist_ok=True)
            subprocess.run(["mount", *how, str(where)], check=True)
            done.append(where)
        yield
    finally:
        for where in reversed(done):
            subprocess.run(["umount", str(where)], check=False)


def test_kernels_and_speculation_are_exact_on_aarch64(smollm_dir):
    if os.geteuid() != 0:
        pytest.fail("the emulated arm64 root needs root (chroot and bind mounts)")
    root = Path(os.environ.get("SSD_ARM_ROOT") or store_root() / "arm64")
    subprocess.run(["bash", str(REPO / "tests" / "arm_root.sh"), str(root), str(REPO)], check=True)
    here = {v: outputs(v) for v in build.runnable_variants()}
    first = next(iter(here.values()))
    for v, out in here.items():
        assert all(torch.equal(out[k], first[k]) for k in first), f"x86 build {v} differs"
    torch.save(first, root / "x86_bits.pt")
    env = ["PATH=/opt/venv/bin:/usr/bin:/bin", "HOME=/root", "SSD_HOME=/ssd-home", "SSD_X86_BITS=/x86_bits.pt",
           "HF_HUB_OFFLINE=1"]
    with mounted(root, smollm_dir.parent):
        run = subprocess.run(["chroot", str(root), "/usr/bin/env", "-i", *env, "/bin/sh", "-c",
                              "cd /repo && python -m pytest -q -p no:cacheprovider " + " ".join(INSIDE)],
                             capture_output=True, text=True, timeout=HOURS * 3600)
    sys.stdout.write(run.stdout[-4000:] + run.stderr[-2000:])
    assert run.returncode == 0, run.stdout[-4000:]
