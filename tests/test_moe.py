"""The mixture-of-experts layer (ssd/layers/moe.py): batch invariance of a row's output whatever
the rows beside it and the experts they chose, on fp32 and GGUF-block experts, and greedy
speculation == AR on a MoE target."""
import pytest
import torch

from ssd import LLM, SamplingParams
from ssd.models.loader import load_model
from ssd.layers.moe import QuantExperts, SparseMoE

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def moe_layers(tiny_models, tmp_path_factory) -> dict[str, SparseMoE]:
    from gguf import GGMLQuantizationType as GGML
    from gguf_models import quantized_copy
    out = {}
    for arch in ("qwen3moe", "qwen2moe"):
        out[arch, "dequantized"] = load_model(tiny_models[arch], CPU, torch.float32, "dequantized").layers[0].mlp
        q8 = quantized_copy(tiny_models[arch], tmp_path_factory.mktemp(f"{arch}-q8"), GGML.Q8_0)
        out[arch, "gguf"] = load_model(q8, CPU, torch.float32, "gguf").layers[0].mlp
    assert isinstance(out["qwen3moe", "gguf"].experts, QuantExperts)
    return out


@pytest.mark.parametrize("weights", ["dequantized", "gguf"])
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_a_rows_output_does_not_depend_on_its_companions(moe_layers, arch, weights):
    """M = 1..16 rows: each row's output has the bits of that row alone, with companions drawn
    afresh for every M (so they route to other experts), and in any order."""
    moe = moe_layers[arch, weights]
    gen = torch.Generator().manual_seed(0)
    probe = torch.randn(4, 64, generator=gen)
    alone = torch.cat([moe(probe[i:i + 1]) for i in range(4)])
    seen = set()
    for m in range(1, 17):
        others = torch.randn(m, 64, generator=gen) * (1 + m % 3)
        x = torch.cat([others[:m // 2], probe, others[m // 2:]])
        seen.update(moe.route(x)[1].flatten().tolist())
        got = moe(x)[m // 2:m // 2 + 4]
        assert torch.equal(got, alone), m
        perm = torch.randperm(len(x), generator=gen)
        assert torch.equal(moe(x[perm])[torch.argsort(perm)], moe(x))
    assert len(seen) == 8, "the companions should reach every expert"


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_the_experts_op_has_the_bits_of_the_python_loop(moe_layers, arch):
    from ssd.kernels import quant_cpu
    moe = moe_layers[arch, "gguf"]
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(3))
    weights, chosen = moe.route(x)
    op = moe.experts.run(x, weights, chosen, 0)
    if quant_cpu.available():
        assert op is not None
        assert torch.equal(op, moe.loop(x, weights, chosen))


def test_router_picks_top_k_and_renormalises(moe_layers):
    moe = moe_layers["qwen3moe", "dequantized"]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    weights, chosen = moe.route(x)
    probs = torch.softmax(moe.gate(x), dim=-1)
    assert torch.equal(chosen, probs.topk(3, dim=-1).indices)
    torch.testing.assert_close(weights.sum(-1), torch.ones(5))


PROMPTS = ["Once upon a time, in a land far away, there lived a king who had three daughters, and",
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"]
GREEDY = SamplingParams.greedy(max_tokens=40, ignore_eos=True)


@pytest.mark.parametrize("arch", ["qwen3moe", "mixtral"])
def test_greedy_speculation_on_a_moe_target_equals_ar(tiny_models, tmp_path, arch):
    """A MoE target on GGUF blocks with a random dense draft of the same vocabulary (SD), its own
    blocks as the draft (every token accepted), prompt lookup and SSD: AR's tokens each time."""
    from gguf import GGMLQuantizationType as GGML
    from gguf_models import quantized_copy
    target = quantized_copy(tiny_models[arch], tmp_path / "target", GGML.Q8_0)
    draft = quantized_copy(tiny_models["llama"], tmp_path / "draft", GGML.Q8_0)
    with LLM(target) as llm:
        expected = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    for kwargs in (dict(draft=draft, mode="sd", speculate_k=3), dict(draft=target, mode="sd", speculate_k=4, draft_quantization="gguf"),
                   dict(draft="ngram", mode="sd", speculate_k=4, ngram_min=1),
                   dict(draft=draft, mode="ssd", speculate_k=3)):
        with LLM(target, **kwargs) as llm:
            outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == expected, kwargs
        if kwargs["draft"] == target:
            assert all(o.metrics.acceptance_rate == 1.0 for o in outs)


def test_a_mixtral_gguf_prepares_as_a_mixture(tiny_models, tmp_path):
    """llama.cpp writes Mixtral as `llama` with expert_count: the store's folder for the file
    alone (config from its metadata) runs the same model as the Hugging Face config does."""
    from gguf import GGMLQuantizationType as GGML
    from gguf_models import quantized_copy
    from ssd.models.config import ModelConfig
    from ssd.store import resolve_model
    copy = quantized_copy(tiny_models["mixtral"], tmp_path / "copy", GGML.Q8_0, metadata=True)
    prepared = resolve_model(copy / "weights.gguf")
    cfg = ModelConfig.from_folder(prepared)
    assert (cfg.arch, cfg.num_experts, cfg.experts_per_token) == ("mixtral", 6, 2)
    with LLM(prepared) as a, LLM(copy) as b:
        assert [o.token_ids for o in a.generate(PROMPTS, GREEDY)] == [o.token_ids for o in b.generate(PROMPTS, GREEDY)]
