"""The fused CPU steps of a decoder layer (ssd/kernels/fused_cpu.py): RoPE with the cache write
gives the bits of the torch code it replaces; RMSNorm is close to torch's and batch-invariant."""
import os
import subprocess
import sys

import torch

from ssd.kernels import fused_cpu
from ssd.layers.rotary import RotaryEmbedding
from kernel_helpers import assert_same_bits_on_any_thread_count, kernel_op


def test_rope_cache_equals_the_torch_expression():
    kernel_op(lambda v=None: fused_cpu.get_op("rope_cache", v), "fused")
    rope = RotaryEmbedding(64, 256, 10000.0, {"rope_type": "default"})
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(7, 6, 64, generator=g), torch.randn(7, 2, 64, generator=g), torch.randn(7, 2, 64, generator=g)
    positions, slots = torch.tensor([0, 3, 9, 10, 11, 200, 255]), torch.tensor([5, 4, 3, 30, 31, 0, 12])
    kc, vc = torch.zeros(40, 2, 64), torch.zeros(40, 2, 64)
    q_rot = fused_cpu.rope_cache(q, k, v, positions, rope.cos, rope.sin, kc, vc, slots)
    want_q, want_k = rope(positions, q, k)
    assert torch.equal(q_rot, want_q) and torch.equal(kc[slots], want_k) and torch.equal(vc[slots], v)
    assert not kc[[i for i in range(40) if i not in slots.tolist()]].any()


def test_rms_norm_close_to_torch_and_batch_invariant(threads):
    kernel_op(lambda v=None: fused_cpu.get_op("rms_norm", v), "fused")
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(9, 1000, generator=g) * 3, torch.randn(1000, generator=g)
    y = fused_cpu.rms_norm(x, w, 1e-6)
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(torch.cat([fused_cpu.rms_norm(x[i:i + 1], w, 1e-6) for i in range(9)]), y)
    assert_same_bits_on_any_thread_count(lambda: [fused_cpu.rms_norm(x, w, 1e-6)])


def test_a_build_killed_midway_does_not_stop_the_next_one(tmp_path):
    """torch's build lock file outlives a build that was killed (Ctrl-C during the first
    compile), and torch waits on it forever: the next process must build all the same."""
    code = ("import sys\n"
            "from ssd.kernels import fused_cpu\n"
            "d = fused_cpu._KERNEL.build_dir(fused_cpu._KERNEL.variant())\n"
            "d.mkdir(parents=True)\n"
            "(d / 'lock').touch()  # as a killed build leaves it\n"
            "sys.exit(0 if fused_cpu._KERNEL.op('rms_norm') is not None else 1)\n")
    env = {**os.environ, "SSD_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
