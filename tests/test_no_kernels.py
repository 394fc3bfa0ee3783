"""Exactness without the C++ kernels (SSD_CPU_KERNELS=off, or no compiler): the plain-torch
fallbacks (ssd/kernels/fallback.py) give a row the same bits alone and in a batch (the unit
tests, bit for bit), so greedy SD still equals AR (end to end, which on its own would rarely
meet a near-tie that a batch-variant fallback flips)."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from ssd.errors import SSDError
from ssd.kernels import attention_cpu, linear_cpu, linear_int8_cpu
from ssd.layers.norm import RMSNorm
from ssd.models.loader import resolve_weights


@pytest.fixture
def no_kernels(monkeypatch, fresh_variant):
    monkeypatch.setenv("SSD_CPU_KERNELS", "off")


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def assert_rows_invariant(f, x: torch.Tensor) -> torch.Tensor:
    """f(x) row for row with the bits of f on each row alone, on leading parts of x and
    with other rows around; returns f(x)."""
    alone = torch.cat([f(x[i:i + 1]) for i in range(len(x))])
    for m in (2, 5, len(x)):
        assert torch.equal(f(x[:m]), alone[:m]), m
    other = randn(6, *x.shape[1:], seed=99)
    for i in (0, 3, len(x) - 1):
        assert torch.equal(f(torch.cat([other[:4], x[i:i + 1], other[4:]]))[4], alone[i]), i
    return alone


def test_linear_rows_are_batch_invariant(no_kernels):
    assert not linear_cpu.available()
    x, w, b = randn(17, 576), randn(1536, 576, seed=1), randn(1536, seed=2)
    y = assert_rows_invariant(lambda rows: linear_cpu.linear(rows, w, b), x)
    torch.testing.assert_close(y, F.linear(x.double(), w.double(), b.double()).float(), rtol=1e-5, atol=1e-4)
    assert linear_cpu.linear(x[:0], w, b).shape == (0, 1536)
    assert torch.equal(linear_cpu.linear(x.view(1, 17, 576), w, b), y.view(1, 17, 1536))


def test_int8_linear_rows_are_batch_invariant(no_kernels):
    assert not linear_int8_cpu.available()
    x, b = randn(17, 576), randn(1536, seed=2)
    q, s = linear_int8_cpu.quantize(randn(1536, 576, seed=1))
    y = assert_rows_invariant(lambda rows: linear_int8_cpu.linear_int8(rows, q, s, b), x)
    want = (x.double() @ q.double().T) * s.double() + b.double()
    torch.testing.assert_close(y, want.float(), rtol=1e-5, atol=1e-4)


def test_rms_norm_rows_are_batch_invariant(no_kernels):
    # Rows wider than torch's parallel grain (32768): there stock torch sums one row in pieces
    # on several threads but each of several rows whole, in another order.
    width = 40000
    norm = RMSNorm(width, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(randn(width, seed=3))
        x = randn(9, width) * 3
        y = assert_rows_invariant(norm, x)
        want = norm.weight.double() * x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
        torch.testing.assert_close(y, want.float(), rtol=1e-5, atol=1e-5)


def test_attention_queries_are_batch_invariant(no_kernels):
    """Each query alone, in its causal chunk, and next to another sequence's queries."""
    assert not attention_cpu.available()
    h, g, d, n = 9, 3, 64, 300
    kc, vc = randn(n, g, d, seed=1), randn(n, g, d, seed=2)
    rows = torch.stack([torch.arange(n), torch.arange(n).flip(0)])  # two sequences' slots
    q = randn(12, h, d, seed=3)
    q_len = torch.tensor([150 + i for i in range(8)] + [40, 41, 42, 43])
    q_row = torch.tensor([0] * 8 + [1] * 4)

    def attend(t: list[int]) -> torch.Tensor:
        return attention_cpu.attention(q[t], kc, vc, rows, q_row[t], q_len[t], d ** -0.5)

    out = attend(list(range(12)))
    for t in range(12):
        assert torch.equal(attend([t]), out[t:t + 1]), t
    assert torch.equal(attend(list(range(3, 8))), out[3:8])  # a chunk of one sequence
    assert torch.equal(attend([9, 2, 10]), out[[9, 2, 10]])
    for t in (0, 7, 11):  # the float64 reference
        k = kc[rows[q_row[t], :q_len[t]]].double().repeat_interleave(h // g, dim=1)
        v = vc[rows[q_row[t], :q_len[t]]].double().repeat_interleave(h // g, dim=1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[t].double(), k) * d ** -0.5, dim=-1)
        torch.testing.assert_close(out[t], torch.einsum("hl,lhd->hd", p, v).float(), rtol=1e-5, atol=1e-5)


def test_gguf_blocks_need_the_kernel(no_kernels, smollm_dir):
    """The quantised matmul has no plain-torch twin: "auto" loads the GGUF model dequantised,
    and asking for its blocks says why not."""
    cpu = torch.device("cpu")
    assert resolve_weights(smollm_dir, cpu, "auto") == "dequantized"
    for weights in ("gguf", "q4_0"):
        with pytest.raises(SSDError, match="switched off by SSD_CPU_KERNELS.*weights='dequantized'"):
            resolve_weights(smollm_dir, cpu, weights)


# In a process of its own, since the kernels' switch is read once per process. One thread: the
# fallbacks make many tiny torch calls, and on a busy machine a parallel one can wait a whole
# time slice for its second thread (8 ms for a softmax of 90 values, against 4 us on one).
GREEDY_SD_AND_AR = """
import json, sys
from ssd.llm import LLM
from ssd.sampling_params import SamplingParams
model, prompts = sys.argv[1], json.loads(sys.argv[2])
params = SamplingParams.greedy(max_tokens=24, ignore_eos=True)
with LLM(model, threads=1) as ar:
    want = [o.token_ids for o in ar.generate(prompts, params)]
with LLM(model, draft=model, mode="sd", speculate_k=4, threads=1) as sd:
    batch = sd.generate(prompts, params)
    alone = sd.generate(prompts[0], params)[0].token_ids
print(json.dumps({"ar": want, "batch": [o.token_ids for o in batch], "alone": alone,
                  "drafted": sum(o.metrics.drafted for o in batch)}))
"""


def test_greedy_sd_equals_ar_without_kernels(smollm_dir):
    prompts = ["def fibonacci(n):", "The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]
    env = {**os.environ, "SSD_CPU_KERNELS": "off"}
    done = subprocess.run([sys.executable, "-c", GREEDY_SD_AND_AR, str(smollm_dir), json.dumps(prompts)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(len(t) == 24 for t in got["ar"])
    assert got["batch"] == got["ar"]
    assert got["alone"] == got["ar"][0]
    assert got["drafted"] > 0
