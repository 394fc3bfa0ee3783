"""Tensor parallelism over gloo (ssd/distributed/tensor_parallel.py): random-weight models of real
layer shapes split across two processes, rank 1 a subprocess serving rank 0's passes.

At TP = 2 a token's logits keep their bits in a verify pass and in decode steps (what exact
greedy SD needs); against TP = 1 they differ only by the order of additions of the split
products (relative 1e-6), and greedy decoding gives the same tokens."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ssd.distributed import tensor_parallel as tp
from ssd.distributed.link import TARGET, connect, listen_socket
from ssd.errors import UnsupportedModelError
from ssd.models.config import ModelConfig
from ssd.models.decoder import DecoderLM
from ssd.models.shard import plan
from ssd.runner.kv_cache import PagedKVCache
from ssd.runner.model_runner import Chunk, ModelRunner

CPU = torch.device("cpu")
# Layer shapes of SmolLM2-135M (9 query heads over 3 kv heads: 2 + 1 at TP = 2, tied head) and
# Qwen2.5-0.5B (q/k/v bias, 14 over 2); two layers and a vocabulary of 4,096 keep them small.
SHAPES = {
    "smollm2": {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
                "num_key_value_heads": 3, "tie_word_embeddings": True, "rms_norm_eps": 1e-5},
    "qwen2.5-0.5b": {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14,
                     "num_key_value_heads": 2, "tie_word_embeddings": False, "rms_norm_eps": 1e-6},
}
SLOTS, BLOCK = 512, 16

WORKER = """
import os, sys, torch
sys.path.insert(0, {tests!r})
from test_tensor_parallel import build, SLOTS, BLOCK
from ssd.distributed import tensor_parallel as tp
from ssd.distributed.link import connect
from ssd.runner.kv_cache import PagedKVCache
group = tp.Group(connect("127.0.0.1", int(sys.argv[1]), 1, 60, "s3cret", world=2), 1, 2)
model = tp.shard(build(sys.argv[2]), group)
tp.serve(model, PagedKVCache(tp.local_config(model), SLOTS, BLOCK, torch.device("cpu"), torch.float32).kv, group)
os._exit(0)  # as ssd/distributed/rank.py: no teardown of gloo's group at interpreter exit
"""


def build(shape: str) -> DecoderLM:
    """The same random weights in every process (a seeded CPU initialisation)."""
    cfg = ModelConfig.from_dict({**SHAPES[shape], "vocab_size": 4096, "num_hidden_layers": 2,
                                 "max_position_embeddings": 1024, "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = DecoderLM(cfg).eval()
    with torch.no_grad():
        model.embed_tokens.weight.normal_(0, 1)  # logits with a spread: few near-ties on the greedy path
    return model


def test_spans_cut_evenly_in_rank_order():
    assert tp.spans(3, 2) == [(0, 2), (2, 3)]
    assert tp.spans(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert tp.spans(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_a_model_that_cannot_be_split_is_refused():
    with pytest.raises(UnsupportedModelError, match="needs as many kv heads"):
        plan(build("qwen2.5-0.5b").config, 0, 3)  # 2 kv heads
    cfg = build("smollm2").config
    with pytest.raises(UnsupportedModelError, match="cut o_proj inside a block"):
        plan(cfg, 1, 2, q_align=256)  # rank 1's query features start at 2 kv heads x 3 x 64 = 384
    with pytest.raises(UnsupportedModelError, match="no whole number of"):
        plan(cfg, 0, 2, inter_align=1000)
    assert plan(cfg, 1, 2, q_align=128, inter_align=256).inter_lo == 768  # 6 blocks of 256: 3 + 3
    model = build("smollm2")
    model.layers[0].mlp.down_proj.quantize_int8()
    with pytest.raises(UnsupportedModelError, match="cuts unquantized weights"):
        tp.shard(model, tp.Group(None, 0, 2))


@pytest.fixture(params=sorted(SHAPES))
def two_ranks(request):
    """(TP = 2 rank 0's runner, TP = 1's runner over the same weights); rank 1 a subprocess."""
    shape = request.param
    listener = listen_socket("127.0.0.1")
    port = listener.getsockname()[1]
    worker = subprocess.Popen([sys.executable, "-c", WORKER.format(tests=str(Path(__file__).parent)), str(port), shape])
    try:
        group = tp.Group(connect("127.0.0.1", port, TARGET, 60, "s3cret", listener=listener, world=2), 0, 2)
        model = tp.shard(build(shape), group)
        runner = ModelRunner(model, PagedKVCache(tp.local_config(model), SLOTS, BLOCK, CPU, torch.float32), CPU)
        ref = build(shape)
        yield runner, ModelRunner(ref, PagedKVCache(ref.config, SLOTS, BLOCK, CPU, torch.float32), CPU)
        group.stop()
        assert worker.wait(timeout=60) == 0
    finally:
        if worker.poll() is None:
            worker.kill()


def passes(runner: ModelRunner, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A prompt chunk's logits; five tokens' logits verified in one pass and decoded one by one;
    twelve greedy tokens."""
    runner.cache.reserve(0, 64)
    prompt = runner.forward([Chunk(0, ids[:10], 0, 10)])
    verify = runner.forward([Chunk(0, ids[10:15], 10, 5)])
    steps = torch.cat([runner.forward([Chunk(0, [t], 10 + i, 1)]) for i, t in enumerate(ids[10:15])])
    assert torch.equal(verify, steps)  # batch-invariant: exact speculation at this TP
    out, tok = [], ids[14]
    for i in range(12):
        tok = int(runner.forward([Chunk(0, [tok], 15 + i, 1)]).argmax())
        out.append(tok)
    runner.cache.release(0)
    return prompt, verify, out


def test_two_ranks_score_as_one(two_ranks):
    runner, ref = two_ranks
    ids = torch.randint(0, 4096, (15,), generator=torch.Generator().manual_seed(1)).tolist()
    prompt, verify, greedy = passes(runner, ids)
    prompt1, verify1, greedy1 = passes(ref, ids)
    for a, b in ((prompt, prompt1), (verify, verify1)):
        assert ((a.double() - b.double()).norm() / b.double().norm()).item() < 1e-5
    assert greedy == greedy1


PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def test_the_engine_at_tp_2_decodes_as_at_tp_1_and_sd_equals_its_ar(smollm_dir):
    """SmolLM2 (3 kv heads: 2 + 1) through LLM. Dequantized, greedy AR at TP = 2 gives TP = 1's
    tokens here. On its GGUF blocks (each rank reads only its cut) TP = 2 is its own reference:
    the 8-bit quantisation of activations turns the split sums' 1e-7 differences into steps (a
    few per cent of the logits after 30 layers), so its tokens part from TP = 1's at the first
    near-tie; SD at TP = 2 (a draft in rank 0's process) and SSD (a draft worker beside the
    ranks) give TP = 2 AR's, token for token."""
    from ssd import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=2, logprobs=1)
    out = {}
    for weights in ("dequantized", "gguf"):
        for n in (1, 2):
            with LLM(smollm_dir, weights=weights, tensor_parallel_size=n, threads=2) as llm:
                assert llm.config.threads == 2 // n
                out[weights, n] = [o.token_ids for o in llm.generate(PROMPTS, params)]
                out[weights, n, "first"] = [o.logprobs[0].logprob for o in llm.generate(PROMPTS, first)]
    assert out["dequantized", 2] == out["dequantized", 1]
    assert [t[:2] for t in out["gguf", 2]] == [t[:2] for t in out["gguf", 1]]
    assert max(abs(a - b) for a, b in zip(out["gguf", 2, "first"], out["gguf", 1, "first"])) < 0.1
    with LLM(smollm_dir, draft=smollm_dir, mode="sd", speculate_k=4, tensor_parallel_size=2, threads=2) as llm:
        sd = [o.token_ids for o in llm.generate(PROMPTS, params)]
    with LLM(smollm_dir, draft=smollm_dir, mode="ssd", speculate_k=2, tensor_parallel_size=2, threads=2) as llm:
        ssd = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert sd == out["gguf", 2] and ssd == out["gguf", 2]


def test_a_rank_that_dies_ends_the_request_with_a_clear_error(smollm_dir):
    from ssd import LLM, SamplingParams
    from ssd.errors import RankError
    with LLM(smollm_dir, tensor_parallel_size=2, threads=2) as llm:
        params = SamplingParams(temperature=0, max_tokens=4)
        assert llm.generate(PROMPTS[0], params)[0].token_ids
        proc = llm.engine.ranks.procs[0]
        proc.kill()
        proc.wait()
        for _ in range(2):  # and every later request, at once
            with pytest.raises(RankError, match="a tensor-parallel rank stopped"):
                llm.generate(PROMPTS[0], params)


def test_a_rank_that_hangs_times_out(smollm_dir):
    """A stopped rank (SIGSTOP: alive, silent) fails the pass after tensor_parallel_timeout."""
    import signal
    import time
    from ssd import LLM, SamplingParams
    from ssd.errors import RankError
    with LLM(smollm_dir, tensor_parallel_size=2, threads=2, tensor_parallel_timeout=2.0) as llm:
        params = SamplingParams(temperature=0, max_tokens=4)
        proc = llm.engine.ranks.procs[0]
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RankError, match="a tensor-parallel rank stopped"):
            llm.generate(PROMPTS[0], params)
        assert time.monotonic() - t0 < 30
    assert proc.poll() is not None, "closing the engine killed the stopped rank"


@pytest.mark.parametrize("options,message", [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"tensor_parallel_size": 4}, "needs as many kv heads"),
    ({"tensor_parallel_size": 2, "weights": "int8"}, "cuts weights='gguf' or 'dequantized'"),
    ({"tensor_parallel_size": 2, "tensor_parallel_timeout": 0}, "tensor_parallel_timeout must be > 0"),
    ({"tensor_parallel_address": "127.0.0.1:5"}, "needs tensor_parallel_size > 1"),
])
def test_tensor_parallel_options_are_checked(smollm_dir, options, message):
    from ssd import LLM
    from ssd.errors import SSDError
    with pytest.raises(SSDError, match=message):
        LLM(smollm_dir, **options)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_rank(port: int, model: Path, secret: str = "rank-secret") -> subprocess.Popen:
    """`ssd rank`, as a user starts one on another host."""
    cmd = [sys.executable, "-c", "import sys; from ssd.cli import main; sys.argv[0] = 'ssd'; sys.exit(main())",
           "rank", "--connect", f"127.0.0.1:{port}", "--rank", "1", "--world", "2", "--model", str(model),
           "--threads", "1"]
    return subprocess.Popen(cmd, env={**os.environ, "SSD_RANK_SECRET": secret}, stderr=subprocess.PIPE, text=True)


def test_a_rank_started_by_hand_joins_at_the_engine_address(smollm_dir, monkeypatch):
    from ssd import LLM, SamplingParams
    monkeypatch.setenv("SSD_RANK_SECRET", "rank-secret")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(smollm_dir, weights="dequantized", threads=2) as llm:
        one = [o.token_ids for o in llm.generate(PROMPTS, params)]
    port = free_port()
    rank = start_rank(port, smollm_dir)
    try:
        with LLM(smollm_dir, weights="dequantized", tensor_parallel_size=2, tensor_parallel_address=f"127.0.0.1:{port}",
                 threads=2) as llm:
            assert [o.token_ids for o in llm.generate(PROMPTS, params)] == one
        assert rank.wait(timeout=60) == 0  # rank 0's close stopped it
    finally:
        rank.kill()


@pytest.mark.parametrize("case", ["another model", "another secret"])
def test_a_rank_started_by_hand_must_match(smollm_dir, tiny_models, monkeypatch, case):
    from ssd import LLM
    from ssd.errors import RankError
    monkeypatch.setenv("SSD_RANK_SECRET", "rank-secret")
    port = free_port()
    rank = start_rank(port, tiny_models["llama"] if case == "another model" else smollm_dir,
                      secret="rank-secret" if case == "another model" else "wrong")
    expected = "holds another model than rank 0's" if case == "another model" else "did not prove"
    try:
        with pytest.raises(RankError, match=expected):
            LLM(smollm_dir, tensor_parallel_size=2, tensor_parallel_address=f"127.0.0.1:{port}", threads=2)
        assert rank.wait(timeout=60) != 0
    finally:
        rank.kill()
