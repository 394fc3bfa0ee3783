import importlib.util

import pytest
import torch
import transformers

from ssd.bench.peers import PeerResult, PeerSkip, isolated, run_hf, run_llamacpp
from ssd.models.loader import transformers_kwargs
from ssd.store import gguf_path

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]
IDS = ["q/0", "q/1"]
N = 10
EOS = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def prompts(smollm_dir) -> list[list[int]]:
    tok = transformers.AutoTokenizer.from_pretrained(smollm_dir)
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                    return_dict=True)["input_ids"] for q in QUESTIONS]


@pytest.fixture(scope="module")
def greedy(smollm_dir, prompts) -> list[list[int]]:
    """Greedy by hand: argmax of a full forward pass per step, no KV cache, no generate()."""
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32,
                                                              **transformers_kwargs(smollm_dir)).eval()
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.inference_mode():
            for _ in range(N):
                x = torch.cat([x, model(x).logits[:, -1].argmax(-1, keepdim=True)], 1)
        outs.append(x[0, len(ids):].tolist())
    return outs


def check_results(results, peer: str, prompts, lengths=(N, N)) -> None:
    assert not isinstance(results, PeerSkip), results.reason
    assert [r.prompt_id for r in results] == IDS and all(r.peer == peer for r in results)
    for r, ids, n in zip(results, prompts, lengths):
        assert isinstance(r, PeerResult)
        assert r.prompt_tokens == len(ids) and r.output_tokens == len(r.token_ids) == n
        assert r.ttft_s > 0 and r.decode_s > 0 and r.tokens_per_second > 0


@pytest.mark.long
def test_hf_is_greedy_and_stops_at_eos(smollm_dir, prompts, greedy):
    # "The capital of France is Paris." ends within N tokens; the haiku does not.
    until_eos = [g[:g.index(EOS) + 1] if EOS in g else g for g in greedy]
    assert [len(g) for g in until_eos] == [8, N] and until_eos[0][-1] == EOS
    results = run_hf(smollm_dir, prompts, IDS, N, threads=2)
    check_results(results, "hf", prompts, [len(g) for g in until_eos])
    assert [r.token_ids for r in results] == until_eos
    assert all(r.tokens_per_second == pytest.approx((r.output_tokens - 1) / r.decode_s) for r in results)


@pytest.mark.long
def test_hf_assisted_same_tokens(smollm_dir, prompts, greedy):
    results = run_hf(smollm_dir, prompts, IDS, N, draft_folder=smollm_dir, ignore_eos=True, threads=2)
    check_results(results, "hf-assisted", prompts)
    assert [r.token_ids for r in results] == greedy


def test_hf_bad_folder_is_skipped(tmp_path, prompts):
    skip = run_hf(tmp_path, prompts, IDS, N)
    assert isinstance(skip, PeerSkip) and skip.peer == "hf" and "transformers failed" in skip.reason


@pytest.mark.parametrize("mode", ["plain", "lookup", "spec"])
def test_llamacpp_runs_or_skips(prompts, mode):
    gguf = gguf_path("smollm2-135m-instruct")
    kwargs = {"lookup": {"prompt_lookup": True}, "spec": {"draft_gguf": gguf}}.get(mode, {})
    peer = {"plain": "llamacpp", "lookup": "llamacpp-lookup", "spec": "llamacpp-spec"}[mode]
    # In a child process, as the bench runs it: a native crash is a skip, not the end of pytest.
    results = isolated(peer, run_llamacpp, gguf, prompts, IDS, N, threads=2, ignore_eos=True, **kwargs)
    if importlib.util.find_spec("llama_cpp") is None:
        assert isinstance(results, PeerSkip) and results.peer == peer
        assert "No module named 'llama_cpp'" in results.reason
    else:
        # llama.cpp's Q4 kernels round differently from the fp32 dequantised weights, so
        # its tokens need not equal transformers'.
        check_results(results, peer, prompts)


def test_llamacpp_spec_with_a_prompt_past_its_batch_size():
    """llama-cpp-python (0.3.x) sizes the logits buffer of a target with a draft model by
    n_batch (512) unless logits_all is passed; a longer prompt used to overflow it."""
    pytest.importorskip("llama_cpp")
    gguf = gguf_path("smollm2-135m-instruct")
    results = isolated("llamacpp-spec", run_llamacpp, gguf, [list(range(1000, 1600))], ["long"], 8, threads=2,
                       ignore_eos=True, draft_gguf=gguf)
    assert not isinstance(results, PeerSkip), results.reason
    assert len(results[0].token_ids) == 8
