import shutil
from pathlib import Path

import pytest
import torch
import transformers

SMOLLM = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    from ssd.store import resolve_model
    return resolve_model(SMOLLM)


@pytest.fixture(scope="session")
def smollm(smollm_dir):
    from ssd import LLM
    with LLM(smollm_dir) as llm:
        yield llm


ARCHS = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3", "qwen3moe", "qwen2moe", "mixtral")
MOE = ("qwen3moe", "qwen2moe", "mixtral")
WINDOW = 16  # the sliding window of the tiny Mistral and Gemma models: shorter than the test prompts


def tiny_config(arch: str, vocab: int) -> transformers.PretrainedConfig:
    """Small configs of the supported architectures, each with its own quirks on: Llama 3's
    RoPE scaling, Qwen2's q/k/v bias, Qwen3's q/k norms; Mistral's and Gemma's sliding windows
    (WINDOW keys, so that they bite), Gemma 2's soft-capping (caps low enough to change the
    values), Gemma 3's own RoPE base on sliding layers and linear scaling on global ones, Phi-3's
    fused projections, LongRoPE and partial rotary; mixtures of experts with top-k > 1."""
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    if arch == "llama":
        return transformers.LlamaConfig(**common, tie_word_embeddings=True, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=False)
    if arch == "mistral":
        return transformers.MistralConfig(**common, sliding_window=WINDOW, tie_word_embeddings=False)
    if arch == "phi3":  # Phi-3's LongRoPE (short factors: the context is the original's) on half of each head
        return transformers.Phi3Config(**common, sliding_window=WINDOW, tie_word_embeddings=False, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "factor": 4.0,
            "short_factor": [1.0, 1.3, 2.1, 3.4], "long_factor": [2.0, 3.0, 5.0, 9.0],
            "original_max_position_embeddings": 512})
    if arch == "qwen3moe":  # 8 experts, 3 a token, renormalised; the middle layer dense (mlp_only_layers)
        return transformers.Qwen3MoeConfig(**common, head_dim=32, num_experts=8, num_experts_per_tok=3,
                                           moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[1],
                                           tie_word_embeddings=False)
    if arch == "qwen2moe":  # a shared expert with its sigmoid gate; weights not renormalised
        return transformers.Qwen2MoeConfig(**common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                           shared_expert_intermediate_size=96, norm_topk_prob=False,
                                           tie_word_embeddings=False)
    if arch == "mixtral":
        return transformers.MixtralConfig(**{**common, "intermediate_size": 64}, num_local_experts=6,
                                          num_experts_per_tok=2, tie_word_embeddings=False)
    if arch == "gemma2":
        return transformers.Gemma2Config(**common, head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                         attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    if arch == "gemma3":
        return transformers.Gemma3TextConfig(
            **common, head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=32,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})
    return transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, smollm_dir) -> dict[str, Path]:
    """Random-weight models of each architecture, saved as Hugging Face folders that carry
    SmolLM2's tokenizer so the whole engine can run them."""
    tok = transformers.AutoTokenizer.from_pretrained(smollm_dir)
    out = {}
    for arch in ARCHS:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch, len(tok)), dtype=torch.float32)
        folder = tmp_path_factory.mktemp(arch)
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        out[arch] = folder
    return out


@pytest.fixture(scope="session")
def truncated_draft(smollm_dir, tmp_path_factory):
    """SmolLM2's GGUF cut to its first 12 of 30 layers: a real draft that often disagrees."""
    from ssd.store import gguf_path
    from gguf_models import truncated_gguf
    return truncated_gguf(gguf_path(SMOLLM), tmp_path_factory.mktemp("smollm-12-layers") / "draft.gguf", 12)


@pytest.fixture
def other_vocab(smollm_dir, tmp_path):
    """The test model with one token added to its table: the same text, another vocabulary."""
    other = tmp_path / "other-vocab"
    shutil.copytree(smollm_dir, other)
    tok = transformers.AutoTokenizer.from_pretrained(smollm_dir)
    tok.add_tokens(["<not-in-the-target>"])
    tok.save_pretrained(other)
    return other


@pytest.fixture(scope="session")
def ar_outputs(smollm):
    def run(prompts, params):
        return [o.token_ids for o in smollm.generate(prompts, params)]
    return run


@pytest.fixture
def threads():
    """Restores torch's thread count after a test that changes it."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture
def own_kernels(monkeypatch):
    """For a test that makes kernels of its own (CppKernel registers each in build.KERNELS):
    they stay out of the engine's list, or every later engine start in this process would try
    to build them beside the real ones (ssd/kernels/prebuild.py: a subprocess each, seconds a
    start, for the rest of the session)."""
    from ssd.kernels import build
    monkeypatch.setattr(build, "KERNELS", [])


@pytest.fixture
def fresh_variant():
    """For a test that changes SSD_CPU_KERNELS: the kernels' cached choice of build
    (ssd.kernels.build.default_variant) is read again before and after it."""
    from ssd.kernels import build
    build.default_variant.cache_clear()
    yield
    build.default_variant.cache_clear()  # re-read after monkeypatch restores the environment


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """A random target over an 8-token vocabulary and a noisy copy of it as the draft."""
    from tiny_pair import make_tiny_pair
    return make_tiny_pair(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_tied_pair(tmp_path_factory):
    """The same with the output layer tied to the input embedding."""
    from tiny_pair import make_tiny_pair
    return make_tiny_pair(tmp_path_factory, tied=True)



@pytest.fixture(scope="session")
def tiny_chars_pair(tmp_path_factory):
    """The same over the letters a..h, whose tokenizer constraints can read."""
    from tiny_pair import make_tiny_pair
    return make_tiny_pair(tmp_path_factory, chars=True)


@pytest.fixture(scope="session")
def tool_model(smollm_dir, tmp_path_factory) -> Path:
    """SmolLM2 with Qwen2.5's chat template, which renders tools and asks for <tool_call>
    blocks (SmolLM2's own template has no tools; here <tool_call> is plain text)."""
    folder = tmp_path_factory.mktemp("smollm-tools")
    for f in smollm_dir.iterdir():
        if f.name != "chat_template.jinja":
            (folder / f.name).symlink_to(f.resolve())
    (folder / "chat_template.jinja").write_text((Path(__file__).parent / "data" / "qwen2.5-chat-template.jinja").read_text())
    return folder


@pytest.fixture(scope="module")
def tool_llm(tool_model):
    """The tool model in this process: what the servers' answers are checked against."""
    from ssd import LLM

    with LLM(tool_model) as llm:
        yield llm


def pytest_sessionfinish(session, exitstatus):
    """A run that checks more p-values than chance.CHECKS would break the suite's bound on failing
    by chance (chance.py): it fails, saying so."""
    import chance
    if chance.checked > chance.CHECKS:
        print(f"\nthis run checked {chance.checked} p-values, more than chance.CHECKS = {chance.CHECKS}: raise CHECKS "
              f"(and so lower chance.PASS) to keep the family-wise bound")
        session.exitstatus = 1
