"""Every build of the CPU kernels gives the same bits, across machines too: on an aarch64
machine (tests/test_arm.py runs this in an emulated one) each NEON build and the portable
build against the x86 builds' outputs on the same inputs, which the caller saved to the file
named by SSD_X86_BITS (tests/kernel_bits.py)."""
import os

import pytest
import torch

from kernel_bits import outputs
from ssd.kernels import build

pytestmark = pytest.mark.skipif(not os.environ.get("SSD_X86_BITS"),
                                reason="compares with x86 outputs that tests/test_arm.py saves")


@pytest.mark.parametrize("variant", build.runnable_variants())
def test_this_build_gives_the_x86_builds_bits(variant):
    want = torch.load(os.environ["SSD_X86_BITS"], weights_only=True)
    got = outputs(variant)
    assert got.keys() == want.keys()
    differ = [name for name in want if not torch.equal(got[name], want[name])]
    assert not differ, f"{variant} differs from the x86 builds on {differ}"
