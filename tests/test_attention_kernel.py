"""The batch-invariant CPU attention kernel (ssd/kernels/attention_cpu.py).

Exactness of speculative decoding rests on it: a query's output must have the same bits
alone, in a causal chunk of any length, next to other sequences, as a draft-tree node with
a row of its own, on any thread count and in every ISA build. The first run compiles every
build this CPU runs (~10 s each, in parallel); later runs load them. Like the linear kernel
it must build wherever the tests run: a missing build fails here instead of skipping.
"""
import types

import pytest
import torch

from ssd.kernels import attention_cpu as A
from ssd.kernels import build
from ssd.layers.attention import Attention, AttentionBatch
from kernel_helpers import assert_same_bits_on_any_thread_count, kernel_op, runnable_builds


@pytest.fixture(scope="module")
def variant():
    kernel_op(A.available, "attention")
    return build.default_variant()


def cache(n_slots, g, d, seed=0, poison=()):
    """K and V caches [n_slots, g, d]; slots in `poison` hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, n_slots, g, d, generator=gen)
    for s in poison:
        k[s] = v[s] = float("nan")
    return k, v


def queries(t, h, d, seed=1, sharp=1.0):
    return torch.randn(t, h, d, generator=torch.Generator().manual_seed(seed)) * sharp


def reference(q, kc, vc, rows, q_row, q_len, scale, softcap=None):
    """softmax(scale q K^T) V in float64 over each query's slots (soft-capped: Gemma 2)."""
    t, h, d = q.shape
    g = kc.shape[1]
    out = torch.empty(t, h, d, dtype=torch.float64)
    for i in range(t):
        slots = rows[q_row[i], :q_len[i]]
        k = kc[slots].double().repeat_interleave(h // g, dim=1)  # [L, H, D]
        v = vc[slots].double().repeat_interleave(h // g, dim=1)
        x = torch.einsum("hd,lhd->hl", q[i].double(), k) * scale
        p = torch.softmax(x if softcap is None else torch.tanh(x / softcap) * softcap, dim=-1)
        out[i] = torch.einsum("hl,lhd->hd", p, v)
    return out


def run(q, kc, vc, rows, q_row, q_len, variant=None, scale=None, softcap=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = A.attention(q, kc, vc, rows, q_row, q_len, scale, softcap, variant=variant)
    assert out is not None and out.dtype == torch.float32 and out.shape == q.shape
    return out


def causal(n_slots, prefix, t, seed=0):
    """One sequence in shuffled slots: t queries after `prefix` cached keys."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randperm(n_slots, generator=gen)[:prefix + t].view(1, -1).contiguous()
    return rows, torch.zeros(t, dtype=torch.long), torch.arange(prefix + 1, prefix + t + 1)


def tree(n_slots, prefix_lens, depth, seed=0):
    """Draft-tree style: branch b has a row of its own (a shared prefix, then its own slots),
    one query per branch at `depth`; rows are padded with slot 0."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n_slots, generator=gen)
    shared = perm[:max(prefix_lens)]
    width = max(prefix_lens) + depth + 2
    rows = torch.zeros(len(prefix_lens), width, dtype=torch.long)
    used = max(prefix_lens)
    for b, p in enumerate(prefix_lens):
        rows[b, :p] = shared[:p]
        rows[b, p:p + depth + 1] = perm[used:used + depth + 1]
        used += depth + 1
    q_len = torch.tensor(prefix_lens) + depth + 1
    return rows, torch.arange(len(prefix_lens)), q_len


SHAPES = [  # (H, G, D): GQA ratios 1..7, D with and without a tail mod 8 / mod 16
    (4, 4, 8), (2, 1, 5), (6, 2, 20), (9, 3, 64), (8, 2, 37), (10, 2, 16), (7, 1, 33),
    (12, 2, 128), (14, 2, 64), (3, 3, 1),
]


@pytest.mark.parametrize("h,g,d", SHAPES)
def test_matches_float64_reference(variant, h, g, d):
    kc, vc = cache(700, g, d)
    cases = []
    for prefix, t in ((0, 1), (0, 37), (19, 17), (250, 50), (0, 300)):  # causal chunks
        cases.append(causal(700, prefix, t, seed=prefix + t))
    cases.append(tree(700, [3, 40, 1, 129], depth=2))
    for i, (rows, q_row, q_len) in enumerate(cases):
        q = queries(len(q_row), h, d, seed=i)
        ref = reference(q, kc, vc, rows, q_row, q_len, d ** -0.5)
        out = run(q, kc, vc, rows, q_row, q_len)
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=4e-6, msg=f"case {i}")


@pytest.mark.parametrize("sharp", [4.0, 40.0])
def test_peaked_softmax(variant, sharp):
    """Large scores: most weights underflow to exactly 0, one key dominates. The fp32 rounding
    of the scores themselves (of q and k) grows with their size, so the bound does too."""
    kc, vc = cache(300, 2, 24)
    rows, q_row, q_len = causal(300, 100, 60)
    q = queries(60, 6, 24, sharp=sharp)
    ref = reference(q, kc, vc, rows, q_row, q_len, 24 ** -0.5)
    out = run(q, kc, vc, rows, q_row, q_len)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=3e-6 + 1e-6 * sharp)


@pytest.mark.parametrize("cap", [1.0, 50.0])
def test_soft_capped_scores(variant, cap):
    """Gemma 2's soft-capping: against float64, and with the bits of each query alone. Sharp
    queries, so a cap of 1 changes the weights a great deal."""
    kc, vc = cache(400, 2, 32)
    rows, q_row, q_len = causal(400, 30, 90)
    q = queries(90, 4, 32, sharp=3.0)
    out = run(q, kc, vc, rows, q_row, q_len, softcap=cap)
    ref = reference(q, kc, vc, rows, q_row, q_len, 32 ** -0.5, cap)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=4e-6)
    assert not torch.allclose(ref, reference(q, kc, vc, rows, q_row, q_len, 32 ** -0.5), atol=1e-3) or cap > 10
    alone = torch.cat([run(q[i:i + 1], kc, vc, rows, q_row[:1], q_len[i:i + 1], softcap=cap) for i in range(90)])
    assert torch.equal(out, alone)


def test_sliding_window_batch(variant):
    """AttentionBatch.windowed: each token sees its last W keys only, in a causal chunk, in a
    batch of two sequences and as tree branches, with the bits of each query alone."""
    w = 16
    kc, vc = cache(600, 2, 32)
    rows, q_row, q_len = causal(600, 10, 60)
    other, _, _ = causal(600, 0, 5, seed=3)
    tr_rows, tr_row, tr_len = tree(600, [40, 3], depth=1, seed=4)
    wide = torch.zeros(4, 80, dtype=torch.long)
    wide[0, :70], wide[1, :5], wide[2:, :tr_rows.shape[1]] = rows[0], other[0], tr_rows
    batch = AttentionBatch(torch.zeros(67, dtype=torch.long), wide, torch.cat([q_row, torch.tensor([1] * 5), tr_row + 2]),
                           torch.cat([q_len, torch.arange(1, 6), tr_len]))
    q = queries(67, 4, 32)
    win = batch.windowed(w)
    assert batch.windowed(w) is win and int(win.q_len.max()) == w
    out = run(q, kc, vc, win.rows, win.q_row, win.q_len)
    ref_rows = torch.zeros(67, w, dtype=torch.long)
    for t in range(67):  # the window by hand: the last w of the token's keys
        n = int(batch.q_len[t])
        keys = batch.rows[batch.q_row[t], max(0, n - w):n]
        ref_rows[t, :len(keys)] = keys
    ref = reference(q, kc, vc, ref_rows, torch.arange(67), batch.q_len.clamp(max=w), 32 ** -0.5)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=4e-6)
    for t in (0, 9, 30, 59, 62, 65, 66):
        alone = AttentionBatch(batch.slot_mapping[t:t + 1], wide, batch.q_row[t:t + 1], batch.q_len[t:t + 1]).windowed(w)
        assert torch.equal(run(q[t:t + 1], kc, vc, alone.rows, alone.q_row, alone.q_len), out[t:t + 1]), t


@pytest.mark.parametrize("h,g,d", [(9, 3, 64), (12, 2, 128), (7, 1, 20), (8, 2, 37)])
def test_batch_invariant_bit_exact(variant, h, g, d):
    kc, vc = cache(900, g, d)
    rows, q_row, q_len = causal(900, 40, 260)
    q = queries(260, h, d)
    chunk = run(q, kc, vc, rows, q_row, q_len)
    alone = torch.cat([run(q[i:i + 1], kc, vc, rows, q_row[:1], q_len[i:i + 1]) for i in range(260)])
    assert torch.equal(chunk, alone)
    for a, b in ((0, 1), (0, 5), (3, 8), (17, 148), (100, 260), (255, 260)):  # shorter chunks
        assert torch.equal(run(q[a:b], kc, vc, rows, q_row[a:b], q_len[a:b]), alone[a:b]), (a, b)
    # queries out of order, next to other sequences whose rows are longer, as rows of their own
    other_rows, _, _ = causal(900, 0, 700, seed=5)
    wide = torch.zeros(4, 720, dtype=torch.long)
    wide[0, :700] = other_rows[0]
    wide[2, :rows.shape[1]] = rows[0]
    wide[3, :rows.shape[1]] = rows[0]
    pick = torch.tensor([250, 3, 0, 77, 78, 259])
    mixed_q = torch.cat([queries(3, h, d, seed=9), q[pick]])
    mixed_row = torch.tensor([0, 1, 0, 2, 3, 2, 3, 3, 2])
    mixed_len = torch.cat([torch.tensor([700, 1, 650]), q_len[pick]])
    got = run(mixed_q, kc, vc, wide, mixed_row, mixed_len)
    assert torch.equal(got[3:], alone[pick])


def test_tree_rows_bit_exact(variant):
    """A draft-tree node gives the same bits as the same keys in a causal row."""
    h, g, d = 12, 2, 64
    kc, vc = cache(600, g, d)
    rows, q_row, q_len = tree(600, [5, 200, 33, 1, 200], depth=3)
    q = queries(5, h, d)
    nodes = run(q, kc, vc, rows, q_row, q_len)
    for b in range(5):
        seq = rows[b:b + 1, :q_len[b]].contiguous()
        alone = run(q[b:b + 1], kc, vc, seq, torch.zeros(1, dtype=torch.long), q_len[b:b + 1])
        assert torch.equal(nodes[b:b + 1], alone), b
    # only some branches live (rows without queries), in another order
    live = torch.tensor([4, 1])
    assert torch.equal(run(q[live], kc, vc, rows, live, q_len[live]), nodes[live])


def test_thread_count_invariant(variant, threads):
    h, g, d = 9, 3, 64
    kc, vc = cache(3000, g, d)
    cases = [causal(3000, 0, 300), causal(3000, 2000, 5), tree(3000, [100, 7, 1000], 2)]
    assert_same_bits_on_any_thread_count(
        lambda: [run(queries(len(qr), h, d), kc, vc, rows, qr, ql) for rows, qr, ql in cases])


def test_padding_never_read(variant):
    """Slots past a query's length hold NaN (or are not even valid slots): outputs stay finite
    and exact; a longer query of the same row that does see the NaN does not leak it."""
    h, g, d = 6, 2, 20
    kc, vc = cache(100, g, d, poison=range(50, 100))
    rows = torch.full((2, 80), -7, dtype=torch.long)  # out-of-range padding
    rows[0, :60] = torch.arange(60)  # keys 50.. are NaN
    rows[1, :30] = torch.arange(30)
    rows[1, 30:40] = torch.arange(60, 70)  # NaN slots past every length of row 1
    q = queries(8, h, d)
    q_row = torch.tensor([0, 0, 0, 0, 1, 1, 1, 0])
    q_len = torch.tensor([1, 49, 50, 7, 30, 1, 17, 60])
    out = run(q, kc, vc, rows, q_row, q_len)
    assert out[:7].isfinite().all() and out[7].isnan().all()
    ref = reference(q[:7], kc, vc, rows, q_row[:7], q_len[:7], d ** -0.5)
    torch.testing.assert_close(out[:7].double(), ref, rtol=0, atol=4e-6)
    for i in range(7):
        assert torch.equal(run(q[i:i + 1], kc, vc, rows, q_row[i:i + 1], q_len[i:i + 1]), out[i:i + 1])


def test_all_builds_give_the_same_bits(variant):
    """The AVX-512, AVX2 and portable builds do the same operations in the same order."""
    variants = runnable_builds()
    for v in variants:
        assert A.available(v), v
    for h, g, d in SHAPES + [(6, 2, 100)]:
        kc, vc = cache(800, g, d)
        for i, (rows, q_row, q_len) in enumerate([causal(800, 0, 45), causal(800, 500, 9),
                                                  tree(800, [17, 300, 2], 1)]):
            q = queries(len(q_row), h, d, sharp=3.0)
            outs = [run(q, kc, vc, rows, q_row, q_len, variant=v) for v in variants]
            for v, o in zip(variants[1:], outs[1:]):
                assert torch.equal(outs[0], o), (v, h, g, d, i)


@pytest.mark.parametrize("softcap", [None, 1.0])
def test_agrees_with_the_sdpa_fallback(variant, softcap):
    """The kernel and Attention._sdpa read rows/q_row/q_len the same way (and soft-cap alike)."""
    h, g, d = 9, 3, 64
    kc, vc = cache(500, g, d)
    rows = torch.zeros(3, 200, dtype=torch.long)
    rows[0, :200] = torch.arange(200)
    rows[1, :50] = torch.arange(300, 350)
    rows[2, :120] = torch.arange(200, 320)
    q_row = torch.tensor([0, 0, 0, 1, 2, 2, 2, 2])
    q_len = torch.tensor([198, 199, 200, 50, 117, 118, 119, 120])
    q = queries(8, h, d)
    batch = AttentionBatch(torch.zeros(8, dtype=torch.long), rows, q_row, q_len)
    layer = types.SimpleNamespace(num_heads=h, num_kv_heads=g, head_dim=d, scale=d ** -0.5, softcap=softcap)
    torch.testing.assert_close(run(q, kc, vc, rows, q_row, q_len, softcap=softcap),
                               Attention._sdpa(layer, q, kc, vc, batch), rtol=0, atol=1e-5)


def test_bad_input_and_fallbacks(variant, monkeypatch):
    kc, vc = cache(50, 2, 16)
    rows, q_row, q_len = causal(50, 0, 4)
    q = queries(4, 4, 16)
    with pytest.raises(RuntimeError, match="slot out of range"):
        run(q, kc, vc, rows + 1000, q_row, q_len)
    with pytest.raises(RuntimeError, match="bad q_row/q_len"):
        run(q, kc, vc, rows, q_row, q_len * 0)
    with pytest.raises(RuntimeError, match="bad q_row/q_len"):
        run(q, kc, vc, rows, q_row + 1, q_len)
    with pytest.raises(RuntimeError, match="scale"):
        run(q, kc, vc, rows, q_row, q_len, scale=-0.25)
    assert run(q[:0], kc, vc, rows, q_row[:0], q_len[:0]).shape == (0, 4, 16)
    assert A.attention(q.double(), kc.double(), vc.double(), rows, q_row, q_len, 0.25) is None
    assert A.attention(q.bfloat16(), kc.bfloat16(), vc.bfloat16(), rows, q_row, q_len, 0.25) is None
    strided = torch.randn(4, 4, 32)[..., ::2]  # non-contiguous q is copied, same bits
    assert torch.equal(run(strided, kc, vc, rows, q_row, q_len),
                       run(strided.contiguous(), kc, vc, rows, q_row, q_len))
    kernel = run(q, kc, vc, rows, q_row, q_len, scale=0.25)
    monkeypatch.setenv("SSD_CPU_KERNELS", "off")
    build.default_variant.cache_clear()
    try:
        assert not A.available()  # plain torch, query by query (tests/test_no_kernels.py)
        torch.testing.assert_close(A.attention(q, kc, vc, rows, q_row, q_len, 0.25), kernel, rtol=0, atol=1e-5)
    finally:
        monkeypatch.undo()
        build.default_variant.cache_clear()
