"""The batch-invariant CPU linear kernel (ssd/kernels/linear_cpu.py) and the Linear layer.

The first run compiles the kernel into $SSD_HOME/kernels: every build this CPU runs, to check
that they agree bit for bit (~25 s on two cores); later runs load it. The kernel must build
wherever the tests run (gcc + ninja): a missing build would silently cost the engine its
speed, so it fails here instead of skipping.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ssd.kernels import linear_cpu as L
from ssd.kernels.build import CppKernel
from ssd.layers.linear import Linear
from kernel_helpers import assert_same_bits_on_any_thread_count, kernel_op, runnable_builds

MS = [1, 2, 3, 4, 5, 7, 8, 9, 17, 64, 300]
SHAPES = [(37, 19), (64, 7), (5, 3), (8, 8), (256, 96), (1000, 130)]  # (K_in, N)


@pytest.fixture(scope="module")
def op():
    return kernel_op(L.get_op, "linear")


def data(M, K, N, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(M, K, generator=g), torch.randn(N, K, generator=g),
            torch.randn(N, generator=g))


@pytest.mark.parametrize("K,N", SHAPES)
def test_matches_f_linear(op, K, N):
    for M in MS:
        x, w, b = data(M, K, N, seed=M)
        for bias in (None, b):
            ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            torch.testing.assert_close(op(x, w, bias), ref.float(), rtol=1e-5, atol=1e-5 * K ** 0.5)


@pytest.mark.parametrize("K,N", [(37, 19), (1000, 130), (1536, 200)])
def test_batch_invariant_bit_exact(op, K, N):
    x, w, b = data(300, K, N)
    alone = torch.cat([op(x[i:i + 1], w, b) for i in range(300)])
    for M in MS:
        assert torch.equal(op(x[:M], w, b), alone[:M]), M
    # the same rows among other neighbours, at other positions
    other = torch.randn(7, K)
    for i in (0, 3, 50, 299):
        batch = torch.cat([other[:3], x[i:i + 1], other[3:]])
        assert torch.equal(op(batch, w, b)[3], alone[i])


def test_thread_count_invariant(op, threads):
    x, w, b = data(37, 300, 1000)
    assert_same_bits_on_any_thread_count(lambda: [op(x[:M], w, b) for M in (1, 5, 37)])


def test_all_builds_give_the_same_bits(op):
    """The AVX-512, AVX2 and portable builds do the same operations in the same order."""
    for v in runnable_builds():
        other = L.get_op(v)
        assert other is not None, v
        for K, N in SHAPES:
            for M in (1, 2, 5, 9, 64):
                x, w, b = data(M, K, N)
                assert torch.equal(op(x, w, b), other(x, w, b)), (v, K, N, M)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_weights_give_the_bits_of_their_fp32_values(op, dtype):
    """fp16 / bf16 weights (a GGUF's F16 / BF16 matrices, kept at half the bytes) are read as
    the fp32 values they hold: the bits of the fp32 copy, on every build, batch-invariant."""
    for K, N in SHAPES + [(1536, 200)]:
        for M in (1, 2, 5, 9, 64):
            x, w, b = data(M, K, N, seed=M)
            w16 = w.to(dtype)
            want = op(x, w16.float(), b)
            for v in runnable_builds():
                assert torch.equal(L.get_op(v)(x, w16, b), want), (v, K, N, M)
            assert torch.equal(L.linear(x, w16, b), want)
    x, w, _ = data(16, 1000, 130)
    alone = torch.cat([op(x[i:i + 1], w.to(dtype), None) for i in range(16)])
    assert torch.equal(op(x, w.to(dtype), None), alone)


def test_strided_and_batched_inputs(op):
    x, w, b = data(6, 40, 24)
    ref = op(x, w, b)
    wide = torch.randn(6, 100)
    wide[:, 10:50] = x
    assert wide[:, 10:50].stride() == (100, 1)
    assert torch.equal(L.linear(wide[:, 10:50], w, b), ref)  # row stride != K, no copy
    assert torch.equal(L.linear(x.t().contiguous().t(), w, b), ref)  # column-major x
    assert torch.equal(L.linear(x, w.t().contiguous().t(), b), ref)  # column-major W
    wwide = torch.randn(24, 90)
    wwide[:, 5:45] = w
    assert torch.equal(L.linear(x, wwide[:, 5:45], b), ref)  # row stride of W != K
    assert torch.equal(L.linear(x.view(2, 3, 40), w, b), ref.view(2, 3, 24))
    assert torch.equal(L.linear(x[2], w, b), ref[2])
    assert L.linear(x[:0], w, b).shape == (0, 24)
    assert torch.equal(L.linear(torch.zeros(3, 0), torch.zeros(24, 0), b), b.expand(3, 24))


def test_fallback_paths(op, monkeypatch, capfd, fresh_variant, own_kernels):
    x, w, b = data(5, 40, 24)
    xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()
    assert torch.equal(L.linear(xb, wb, bb), F.linear(xb, wb, bb))  # not fp32: F.linear
    x64 = x.double()
    assert torch.equal(L.linear(x64, w.double()), F.linear(x64, w.double()))
    # without the kernel: F.linear on each row alone (batch-invariant, ssd/kernels/fallback.py)
    by_row = torch.cat([F.linear(x[i:i + 1].clone(), w, b) for i in range(len(x))])
    monkeypatch.setenv("SSD_CPU_KERNELS", "off")
    L.default_variant.cache_clear()
    assert not L.available()
    assert torch.equal(L.linear(x, w, b), by_row)
    # a build that fails (no compiler, no ninja, ...) warns once and falls back
    monkeypatch.setenv("SSD_CPU_KERNELS", "auto")
    L.default_variant.cache_clear()
    broken = CppKernel("linear")
    monkeypatch.setattr(broken, "_build", lambda v: (_ for _ in ()).throw(RuntimeError("no compiler")))
    monkeypatch.setattr(L, "_KERNEL", broken)
    assert torch.equal(L.linear(x, w, b), by_row)
    assert "unavailable, running without it (slower, still batch-invariant)" in capfd.readouterr().err
    assert not L.available()


def test_linear_layer_is_a_drop_in(op):
    torch.manual_seed(0)
    ref = nn.Linear(40, 24)
    lin = Linear(40, 24)
    assert [k for k, _ in lin.named_parameters()] == ["weight", "bias"]
    lin.load_state_dict(ref.state_dict())
    assert Linear(40, 24, bias=False).bias is None
    x = torch.randn(3, 5, 40)
    with torch.no_grad():
        torch.testing.assert_close(lin(x), ref(x), rtol=1e-5, atol=1e-5)
        assert torch.equal(lin(x), op(x.view(15, 40), lin.weight, lin.bias).view(3, 5, 24))
    # with gradients on, the forward is the same kernel and the backward is right
    x.requires_grad_(True)
    y = lin(x)
    with torch.no_grad():
        assert torch.equal(y.detach(), op(x.view(15, 40), lin.weight, lin.bias).view(3, 5, 24))
    y.square().sum().backward()
    ref(x.detach().requires_grad_(True)).square().sum().backward()
    for p, q in zip(lin.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)
