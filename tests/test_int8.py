"""The weight-only int8 CPU linear kernel (ssd/kernels/linear_int8_cpu.py), the int8 Linear
and int8 model loading.

Like tests/test_linear_kernel.py, the first run compiles every build this CPU runs (~30 s
on two cores) and fails, rather than skips, when the default build does not compile.
"""
import pytest
import torch
import torch.nn.functional as F

from ssd.errors import SSDError
from ssd.kernels import linear_int8_cpu as Q
from ssd.kernels.build import CppKernel
from ssd.layers.linear import Linear
from ssd.models.loader import load_model
from kernel_helpers import assert_same_bits_on_any_thread_count, kernel_op, runnable_builds

MS = [1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 17, 24, 33, 49, 70]
SHAPES = [(37, 19), (64, 7), (5, 3), (16, 8), (256, 96), (1000, 130), (896, 40)]  # (K_in, N)


@pytest.fixture(scope="module")
def op():
    return kernel_op(Q.get_op, "int8 linear")


def data(M, K, N, seed=0):
    """x, int8 weights with their scales (from a random fp32 matrix), bias."""
    g = torch.Generator().manual_seed(seed)
    q, s = Q.quantize(torch.randn(N, K, generator=g))
    return torch.randn(M, K, generator=g), q, s, torch.randn(N, generator=g)


def reference(x, q, s, b=None):
    y = (x.double() @ q.double().T) * s.double()
    return (y if b is None else y + b.double()).float()


def test_quantize_round_trip():
    w = torch.randn(50, 37)
    w[3] = 0  # a zero row: scale 0, no division by zero
    q, s = Q.quantize(w, rows_per_step=16)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s[3] == 0 and not q[3].any()
    assert q.abs().max() == 127 and q.abs().amax(1)[s > 0].eq(127).all()
    err = (q.float() * s[:, None] - w).abs()
    assert (err <= s[:, None] / 2 * (1 + 1e-6)).all()  # round to nearest


@pytest.mark.parametrize("K,N", SHAPES)
def test_matches_float64_reference(op, K, N):
    for M in MS:
        x, q, s, b = data(M, K, N, seed=M)
        for bias in (None, b):
            # fp32 accumulation over K terms of size ~|x| * 127 * scale
            tol = 2e-6 * K ** 0.5 * 127 * s.max().item()
            torch.testing.assert_close(op(x, q, s, bias), reference(x, q, s, bias),
                                       rtol=1e-5, atol=tol)


@pytest.mark.parametrize("K,N", [(37, 19), (896, 130), (1000, 67)])
def test_batch_invariant_bit_exact(op, K, N):
    x, q, s, b = data(70, K, N)
    alone = torch.cat([op(x[i:i + 1], q, s, b) for i in range(70)])
    for M in MS:
        assert torch.equal(op(x[:M], q, s, b), alone[:M]), M
    other = torch.randn(30, K)
    for i in (0, 3, 50, 69):  # the same row among other neighbours, at other positions
        for at in (0, 5, 11, 29):
            batch = torch.cat([other[:at], x[i:i + 1], other[at:]])
            assert torch.equal(op(batch, q, s, b)[at], alone[i]), (i, at)


def test_thread_count_invariant(op, threads):
    x, q, s, b = data(37, 300, 1000)
    assert_same_bits_on_any_thread_count(lambda: [op(x[:M], q, s, b) for M in (1, 5, 9, 37)])


@pytest.mark.long
def test_all_builds_give_the_same_bits(op):
    """The AVX-512, AVX2 and portable builds do the same operations in the same order."""
    for v in runnable_builds():
        other = Q.get_op(v)
        assert other is not None, v
        for K, N in SHAPES:
            for M in (1, 2, 3, 5, 8, 9, 13, 24, 70):
                x, q, s, b = data(M, K, N)
                assert torch.equal(op(x, q, s, b), other(x, q, s, b)), (v, K, N, M)


def test_strided_and_batched_inputs(op):
    x, q, s, b = data(6, 40, 24)
    ref = op(x, q, s, b)
    wide = torch.randn(6, 100)
    wide[:, 10:50] = x
    assert torch.equal(Q.linear_int8(wide[:, 10:50], q, s, b), ref)  # row stride != K
    assert torch.equal(Q.linear_int8(x.t().contiguous().t(), q, s, b), ref)  # column-major x
    qwide = torch.zeros(24, 90, dtype=torch.int8)
    qwide[:, 5:45] = q
    assert torch.equal(Q.linear_int8(x, qwide[:, 5:45], s, b), ref)  # row stride of W != K
    assert torch.equal(Q.linear_int8(x.view(2, 3, 40), q, s, b), ref.view(2, 3, 24))
    assert torch.equal(Q.linear_int8(x[2], q, s, b), ref[2])
    assert Q.linear_int8(x[:0], q, s, b).shape == (0, 24)


def test_fallback_paths(op, monkeypatch, capfd, fresh_variant, own_kernels):
    x, q, s, b = data(5, 40, 24)
    ref = reference(x, q, s, b)
    xb = x.bfloat16()  # not fp32: stock ops in bf16
    yb = Q.linear_int8(xb, q, s, b)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), ref, rtol=2e-2, atol=2e-2 * s.max().item() * 127)
    monkeypatch.setenv("SSD_CPU_KERNELS", "off")
    Q.default_variant.cache_clear()
    assert not Q.available()
    torch.testing.assert_close(Q.linear_int8(x, q, s, b), ref, rtol=1e-5, atol=1e-4)
    # a build that fails (no compiler, no ninja, ...) warns once and falls back
    monkeypatch.setenv("SSD_CPU_KERNELS", "auto")
    Q.default_variant.cache_clear()
    broken = CppKernel("linear_int8")
    monkeypatch.setattr(broken, "_build",
                        lambda v: (_ for _ in ()).throw(RuntimeError("no compiler")))
    monkeypatch.setattr(Q, "_KERNEL", broken)
    torch.testing.assert_close(Q.linear_int8(x, q, s, b), ref, rtol=1e-5, atol=1e-4)
    assert "unavailable" in capfd.readouterr().err
    assert not Q.available()


def test_linear_layer_quantizes_in_place(op):
    torch.manual_seed(0)
    lin = Linear(40, 24)
    w, bias = lin.weight.detach().clone(), lin.bias.detach().clone()
    x = torch.randn(3, 5, 40)
    with torch.no_grad():
        y32 = lin(x)
        lin.quantize_int8()
        assert not hasattr(lin, "weight")
        assert lin.qweight.dtype == torch.int8 and lin.bias is not None
        y8 = lin(x)
    q, s = Q.quantize(w)
    assert torch.equal(lin.qweight, q) and torch.equal(lin.weight_scale, s)
    assert torch.equal(y8, op(x.view(15, 40), q, s, bias).view(3, 5, 24))
    torch.testing.assert_close(y8, y32, rtol=0.05, atol=0.05)
    assert set(lin.state_dict()) == {"qweight", "weight_scale", "bias"}


def test_load_model_rejects_unknown_weights(smollm_dir):
    with pytest.raises(SSDError, match="int4"):
        load_model(smollm_dir, torch.device("cpu"), torch.float32, weights="int4")


def test_smollm2_int8_logits_close_to_fp32(op, smollm_dir):
    """Tied embeddings: the lookup keeps the fp32 table, the head runs on an int8 copy."""
    import transformers

    from ssd.runner.kv_cache import PagedKVCache
    from ssd.runner.model_runner import Chunk, ModelRunner

    tok = transformers.AutoTokenizer.from_pretrained(smollm_dir)
    ids = tok("The quick brown fox jumps over the lazy dog. In Python, a list comprehension "
              "builds a new list from an iterable: squares = [x * x for x in range(10)].").input_ids
    cpu = torch.device("cpu")

    def runner(model):
        cache = PagedKVCache(model.config, 256, 16, cpu, torch.float32)
        cache.reserve(0, len(ids))
        return ModelRunner(model, cache, cpu)

    logits = {}
    for weights in ("dequantized", "int8"):
        model = load_model(smollm_dir, cpu, torch.float32, weights)
        logits[weights] = runner(model).forward([Chunk(0, ids, 0, len(ids))])
    assert model.embed_tokens.weight.dtype == torch.float32
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(lin.qweight.dtype == torch.int8 for lin in linears)
    a, b = logits["dequantized"], logits["int8"]
    # measured: top-1 agreement 38/39 positions, cosine min 0.995, mean 0.9989
    top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    cos = F.cosine_similarity(a, b, dim=-1)
    assert top1 >= 0.9 and cos.min() > 0.98 and cos.mean() > 0.995, (top1, cos)

    # batch-invariant end to end: scoring 9 tokens in one pass gives the bits of 9 decodes
    split = len(ids) - 9
    one, each = runner(model), runner(model)
    one.forward([Chunk(0, ids[:split], 0, split)])
    each.forward([Chunk(0, ids[:split], 0, split)])
    rows = [each.forward([Chunk(0, [t], i, 1)]) for i, t in enumerate(ids[split:], split)]
    assert torch.equal(one.forward([Chunk(0, ids[split:], split, 9)]), torch.cat(rows))
