"""The GGUF-quantised CPU kernel (ssd/kernels/quant_cpu.py, csrc/quant.cpp): every supported
type against the gguf package's dequantisation, batch invariance, every build giving the same
bits, the embedding lookup, and loading a real GGUF model on its blocks.

Blocks are random bytes with sane fp16 scales, so every bit pattern of the quants and
sub-block scales is exercised; the first run compiles every build this CPU runs."""
import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGML

from ssd.kernels import quant_cpu as Q
from kernel_helpers import assert_same_bits_on_any_thread_count, kernel_op

TYPES = sorted(Q.SUPPORTED, key=int)
# Offsets of each type's fp16 scales inside its GGUF block (d, and m / dmin where there is one).
HALVES = {GGML.Q4_0: (0,), GGML.Q4_1: (0, 2), GGML.Q5_0: (0,), GGML.Q5_1: (0, 2), GGML.Q8_0: (0,),
          GGML.Q4_K: (0, 2), GGML.Q5_K: (0, 2), GGML.Q6_K: (208,), GGML.Q2_K: (80, 82), GGML.IQ4_XS: (0,),
          GGML.Q3_K: (108,), GGML.IQ4_NL: (0,)}


@pytest.fixture(scope="module")
def op():
    return kernel_op(lambda v=None: Q.get_op("qlinear", v), "quant")


def blocks(qtype: GGML, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random GGUF data of a [rows, cols] tensor: random quants and sub-scales, fp16 scales in
    a plausible range (some negative: GGUF allows it)."""
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * cols // per, size), dtype=np.uint8)
    for off in HALVES[qtype]:
        half = (rng.uniform(0.002, 0.02, raw.shape[0]) * rng.choice([-1, 1], raw.shape[0])).astype(np.float16)
        raw[:, off:off + 2] = half.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(raw.reshape(-1))


def dequantized(qtype: GGML, raw: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype)).reshape(rows, cols)


def bound(x: torch.Tensor, w: torch.Tensor, block: int) -> torch.Tensor:
    """How far x @ w.T may be from its float64 value, per output: each activation block is
    rounded to steps of d = amax / 127, so each value moves by at most d / 2, and the error is
    at most sum_b d_b / 2 * sum_{i in b} |w_i|; fp32 accumulation adds ~1e-6 of sum |w x|."""
    m, k = x.shape
    xb = x.double().view(m, k // block, block)
    half_step = xb.abs().amax(-1) / 127 / 2  # [M, blocks]
    wabs = w.double().abs().view(w.shape[0], k // block, block).sum(-1)  # [N, blocks]
    return half_step @ wabs.T * (1 + 1e-6) + 1e-6 * (x.double().abs() @ w.double().abs().T) + 1e-30


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_each_type_within_the_8_bit_activation_bound(op, qtype):
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    k = 2 * block if block == 256 else 96
    n = 37  # not a multiple of the 16-row groups: the last group is padded
    raw = blocks(qtype, n, k)
    w = dequantized(qtype, raw, n, k)
    m = Q.repack(raw, qtype, n, k)
    g = torch.Generator().manual_seed(1)
    for rows in (1, 5, 8, 11):
        x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4
        x[0, :7] = 0  # a partly zero block and a wholly zero row below
        if rows > 2:
            x[2] = 0
        y = Q.qlinear(x, [m])
        err = (y.double() - x.double() @ w.double().T).abs()
        assert (err <= bound(x, w, Q.ACTIVATION_BLOCK)).all(), (qtype.name, rows, block, err.max().item())


def test_activations_are_quantised_per_block_and_row(op):
    block = Q.ACTIVATION_BLOCK
    x = torch.randn(3, 8 * block) * 3
    x[1, 40] = 80  # an outlier coarsens only its own block
    q, d = Q.quantize_rows(x)
    xb = x.view(3, 8, block)
    amax = xb.abs().amax(-1)
    assert torch.equal(d, amax / 127)
    want = torch.round(xb * (127 / amax)[..., None]).clamp(-127, 127).to(torch.int8).view(3, -1)
    assert torch.equal(q, want)  # round half to even, like torch.round


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_batch_invariant_and_the_same_bits_as_the_portable_code(op, qtype, threads):
    k = 768 if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 160
    n = 70
    m = Q.repack(blocks(qtype, n, k, seed=int(qtype)), qtype, n, k)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, k, generator=g)
    alone = torch.cat([Q.qlinear(x[i:i + 1], [m]) for i in range(16)])
    assert torch.equal(alone, Q.qlinear(x, [m], reference=True))
    for rows in range(1, 17):
        companions = torch.randn(rows - 1, k, generator=g) * 10  # other rows, other scales
        for pos in {0, rows - 1}:
            batch = torch.cat([companions[:pos], x[rows - 1:rows], companions[pos:]])
            assert torch.equal(Q.qlinear(batch, [m])[pos], alone[rows - 1]), (qtype.name, rows, pos)
    assert_same_bits_on_any_thread_count(lambda: [Q.qlinear(x, [m])])


@pytest.mark.parametrize("qtype", [GGML.Q4_0, GGML.Q8_0, GGML.Q2_K, GGML.Q4_K, GGML.Q6_K, GGML.IQ4_XS],
                         ids=lambda t: t.name)
def test_a_large_matrix_on_several_threads_equals_the_portable_code(op, qtype, threads):
    """Enough 16-row groups for every thread (small matrices run on the caller's thread alone)."""
    n, k = 16 * 8 * 4 + 5, 2560
    m = Q.repack(blocks(qtype, n, k, seed=5), qtype, n, k)
    x = torch.randn(21, k, generator=torch.Generator().manual_seed(6))
    for rows in (1, 5, 9, 21):  # (21: more than one tile of rows on every build)
        want = Q.qlinear(x[:rows], [m], reference=True)
        assert_same_bits_on_any_thread_count(lambda: [Q.qlinear(x[:rows], [m])])
        assert torch.equal(Q.qlinear(x[:rows], [m]), want), (qtype.name, rows)


def test_every_build_quantises_activations_alike(op):
    """The SIMD builds quantise x with vector code: the same q and scales as the scalar loop,
    on ties (x * 127 / amax at .5), zero blocks, a NaN (skipped by the max) and an inf."""
    x = torch.randn(6, 256) * 3
    x[0, :40] = 0
    x[1, 5] = float("nan")
    x[2, 3] = float("inf")
    x[3, :32] = torch.arange(32) - 15.5  # with amax = 127 below: x * 127 / amax = x, every one a tie
    x[3, 31] = 127
    x[4, 32:64] = 1e-39  # subnormal
    builds = Q.runnable_variants()
    outs = [Q.quantize_rows(x, variant=v) for v in builds]
    for q, d in outs[1:]:
        assert torch.equal(q, outs[0][0]) and torch.equal(d.nan_to_num(-1), outs[0][1].nan_to_num(-1)), builds


def test_every_build_gives_the_same_bits(op):
    builds = Q.runnable_variants()
    if len(builds) < 2:
        pytest.skip("only the portable build runs here")
    x = torch.randn(9, 512)
    for qtype in TYPES:
        raw = blocks(qtype, 40, 512, seed=3)
        outs = [Q.qlinear(x, [Q.repack(raw, qtype, 40, 512, variant=v)], variant=v) for v in builds]
        assert all(torch.equal(outs[0], o) for o in outs[1:]), qtype.name


def test_parts_of_different_types_with_a_bias(op):
    """A fused projection (q, k, v of one attention) whose parts have different types."""
    k = 512
    kinds = [(GGML.Q4_K, 48), (GGML.Q4_K, 16), (GGML.Q6_K, 20)]
    raws = [blocks(t, n, k, seed=i) for i, (t, n) in enumerate(kinds)]
    parts = [Q.repack(r, t, n, k) for r, (t, n) in zip(raws, kinds)]
    bias = torch.randn(sum(n for _, n in kinds))
    x = torch.randn(4, k)
    y = Q.qlinear(x, parts, bias)
    alone = torch.cat([Q.qlinear(x, [p]) for p in parts], dim=1)
    assert torch.equal(y, alone + bias)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_embedding_rows_equal_the_gguf_dequantisation(op, qtype):
    k = 512
    raw = blocks(qtype, 50, k, seed=4)
    ids = torch.tensor([0, 49, 7, 7, 23])
    assert torch.equal(Q.dequant_rows(raw, qtype, ids, k), dequantized(qtype, raw, 50, k)[ids])


def test_bad_inputs_are_errors_not_crashes(op):
    raw = blocks(GGML.Q4_K, 16, 256)
    with pytest.raises(RuntimeError, match="unsupported GGUF type"):
        Q.repack(raw, GGML.IQ2_XS, 16, 256)
    with pytest.raises(RuntimeError, match="expected"):
        Q.repack(raw[:-1], GGML.Q4_K, 16, 256)
    with pytest.raises(RuntimeError, match="out of range"):
        Q.dequant_rows(raw, GGML.Q4_K, torch.tensor([16]), 256)
    m = Q.repack(raw, GGML.Q4_K, 16, 256)
    with pytest.raises(ValueError, match="255 features"):
        Q.qlinear(torch.randn(2, 255), [m])
    with pytest.raises(RuntimeError, match="fp32"):
        Q.qlinear(torch.randn(2, 256, dtype=torch.float64), [m])


def test_q4_0_requantisation_has_the_gguf_package_bits():
    """A draft requantised to Q4_0 (weights="q4_0") gets the blocks gguf's (ggml's reference)
    quantiser makes: ties of magnitude, an all-zero block, a constant block, tiny values."""
    w = torch.randn(40, 512, generator=torch.Generator().manual_seed(5)) * 0.05
    w[0, :32] = 0
    w[1, :32], w[1, 5] = 1.0, -1.0  # +1 and -1: the first of equal magnitudes sets the sign
    w[2, :32] = torch.linspace(-1, 1, 32)
    w[3, :32] = -3.0
    w[4] *= 1e-6
    ref = gguf.quants.quantize(w.numpy(), GGML.Q4_0)
    assert np.array_equal(Q.quantize_q4_0(w).numpy(), ref)
    with pytest.raises(ValueError, match="multiple of 32"):
        Q.quantize_q4_0(torch.randn(2, 48))


def test_each_part_on_its_own_rows_has_the_bits_of_qlinear_alone(op):
    """qlinear_each (a mixture's down projections in one pass): part i on xs[i], each output
    with the bits of qlinear on that part and x alone, whatever the other parts and their rows."""
    g = torch.Generator().manual_seed(5)
    kinds = [GGML.Q4_K, GGML.Q6_K, GGML.Q8_0, GGML.Q4_K, GGML.Q5_0]
    mats = [Q.repack(blocks(t, 40 + 16 * i, 256), t, 40 + 16 * i, 256) for i, t in enumerate(kinds)]
    xs = [torch.randn(m, 256, generator=g) for m in (1, 3, 1, 9, 2)]
    ys = Q.get_op("qlinear_each")(xs, [m.packed for m in mats], [int(m.qtype) for m in mats],
                                  [m.rows for m in mats], 256)
    for x, m, y in zip(xs, mats, ys):
        assert torch.equal(y, Q.qlinear(x, [m]))
