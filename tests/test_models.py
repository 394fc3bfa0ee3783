"""Our model implementations against transformers on the same weights (fp32), and the GGUF-block
weights (8-bit activations) against those fp32 values."""
import pytest
import torch
import transformers

from ssd import LLM, SamplingParams
from ssd.layers.linear import QuantLinear
from ssd.models.loader import load_model, transformers_kwargs
from ssd.runner.kv_cache import PagedKVCache
from ssd.runner.model_runner import Chunk, ModelRunner
from conftest import ARCHS, WINDOW

CPU = torch.device("cpu")


def our_logits(folder, ids: list[int], split: int, weights: str = "dequantized") -> torch.Tensor:
    """Logits at every position: a prefill of ids[:split], then one decode step per token."""
    model = load_model(folder, CPU, torch.float32, weights)
    cache = PagedKVCache(model.config, 1024, 16, CPU, torch.float32)
    runner = ModelRunner(model, cache, CPU)
    cache.reserve(0, len(ids))
    rows = [runner.forward([Chunk(0, ids[:split], 0, split)])]
    rows += [runner.forward([Chunk(0, [t], i, 1)]) for i, t in enumerate(ids[split:], split)]
    return torch.cat(rows)


def hf_logits(folder, ids: list[int]) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                           **transformers_kwargs(folder)).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_random_weights_match_transformers(tiny_models, arch):
    ids = torch.randint(0, 1000, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    ours, ref = our_logits(tiny_models[arch], ids, 50), hf_logits(tiny_models[arch], ids)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_smollm2_logits_match_transformers(smollm_dir):
    tok = transformers.AutoTokenizer.from_pretrained(smollm_dir)
    ids = tok("def fibonacci(n):\n    if n <= 1:\n        return n\n").input_ids
    ours, ref = our_logits(smollm_dir, ids, len(ids) - 6), hf_logits(smollm_dir, ids)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=2e-4)


def test_smollm2_gguf_blocks_close_to_fp32(smollm_dir):
    """The default CPU path (the file's Q4_1/Q8_0 blocks, 8-bit activations) against the fp32
    values of the same file: the same next token almost everywhere, nearly the same logits.
    Measured: top-1 agreement 51/52 positions, cosine min 0.997."""
    tok = transformers.AutoTokenizer.from_pretrained(smollm_dir)
    ids = tok("The quick brown fox jumps over the lazy dog. In Python, a list comprehension builds a new "
              "list from an iterable: squares = [x * x for x in range(10)]. Then print(squares).").input_ids
    q, f = our_logits(smollm_dir, ids, len(ids) - 8, "gguf"), our_logits(smollm_dir, ids, len(ids) - 8)
    top1 = (q.argmax(-1) == f.argmax(-1)).float().mean().item()
    cos = torch.nn.functional.cosine_similarity(q, f, dim=-1)
    assert top1 >= 0.9 and cos.min() > 0.98 and cos.mean() > 0.995, (top1, cos.min().item())


def test_smollm2_requantised_to_q4_0_close_to_its_blocks(smollm_dir):
    """weights="q4_0" (a draft's cheaper step): each matrix of more than 5 bits a weight becomes
    Q4_0, the rest keep the file's blocks; the logits stay close to the file's.
    Measured: top-1 agreement 43/45 positions, cosine min 0.981, mean 0.993."""
    model = load_model(smollm_dir, CPU, torch.float32, "q4_0")
    types = {n: {p.qtype.name for p in m.parts} for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert types.pop("lm_head") == {"Q4_0"}  # the tied head: the file's Q8_0 embedding, requantised
    assert all(t == {"Q4_1"} for t in types.values())  # 5.0 bits a weight: kept
    tok = transformers.AutoTokenizer.from_pretrained(smollm_dir)
    ids = tok("The quick brown fox jumps over the lazy dog. In Python, a list comprehension builds a new "
              "list from an iterable: squares = [x * x for x in range(10)]. Then print(squares).").input_ids
    q, f = our_logits(smollm_dir, ids, len(ids) - 8, "q4_0"), our_logits(smollm_dir, ids, len(ids) - 8, "gguf")
    top1 = (q.argmax(-1) == f.argmax(-1)).float().mean().item()
    cos = torch.nn.functional.cosine_similarity(q, f, dim=-1)
    assert top1 >= 0.9 and cos.min() > 0.95 and cos.mean() > 0.98, (top1, cos.min().item(), cos.mean().item())


def run_steps(model, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a prefill, a decode step, a 5-token verify pass and a batch of two sequences,
    and the KV cache they leave, with the layers as one op (fused) or the Python loop."""
    model.fused_layers = fused
    cache = PagedKVCache(model.config, 512, 16, CPU, torch.float32)
    cache.kv.zero_()  # slots never written compare equal
    runner = ModelRunner(model, cache, CPU)
    ids = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    cache.reserve(0, 40)
    cache.reserve(1, 40)
    out = [runner.forward([Chunk(0, ids[:20], 0, 20)]), runner.forward([Chunk(0, ids[20:21], 20, 1)]),
           runner.forward([Chunk(0, ids[21:26], 21, 5)]),
           runner.forward([Chunk(1, ids[5:30], 0, 3), Chunk(0, ids[26:28], 26, 2)])]
    return torch.cat(out), cache.kv.clone()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3", "qwen3moe", "mixtral", "smollm2"])
def test_layer_stack_op_has_the_bits_of_the_python_loop(tiny_models, smollm_dir, tmp_path, monkeypatch, arch):
    """The decoder layers as one CPU op (GGUF blocks) give the Python loop's logits and KV cache
    bit for bit."""
    from gguf import GGMLQuantizationType as GGML
    from gguf_models import quantized_copy
    from ssd.kernels import decoder_cpu, quant_cpu
    folder = smollm_dir if arch == "smollm2" else quantized_copy(tiny_models[arch], tmp_path, GGML.Q8_0)
    model = load_model(folder, CPU, torch.float32, "gguf")
    assert model.layer_stack() is not None
    ran = []
    run = decoder_cpu.LayerStack.run
    monkeypatch.setattr(decoder_cpu.LayerStack, "run", lambda self, *a: ran.append(run(self, *a)) or ran[-1])
    fused, loop = run_steps(model, True), run_steps(model, False)
    assert torch.equal(fused[0], loop[0]) and torch.equal(fused[1], loop[1])
    if quant_cpu.available():  # the op ran, not the loop behind it
        assert len(ran) == 4 and all(r is not None for r in ran)


@pytest.mark.parametrize("weights", ["dequantized", "gguf"])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_decode_give_the_same_bits(tiny_models, tmp_path, arch, weights):
    """Batch invariance through a whole model: a token's logits have the same bits whether it
    is scored in a prefill of 30 tokens or decoded alone (Qwen3's q/k norms once broke this:
    the fused norm ran only where the view happened to be contiguous, one token)."""
    folder = tiny_models[arch]
    if weights == "gguf":
        from gguf import GGMLQuantizationType as GGML
        from gguf_models import quantized_copy
        folder = quantized_copy(folder, tmp_path, GGML.Q8_0)
    ids = torch.randint(0, 1000, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    assert torch.equal(our_logits(folder, ids, 30, weights), our_logits(folder, ids, 10, weights))


def test_smollm2_greedy_generation_matches_transformers(smollm_dir):
    prompt = "The three primary colors are"
    with LLM(smollm_dir, weights="dequantized") as llm:
        out = llm.generate(prompt, SamplingParams.greedy(max_tokens=24, ignore_eos=True))[0]
        ids = llm.tokenizer(prompt, return_tensors="pt").input_ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32,
                                                           **transformers_kwargs(smollm_dir)).eval()
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)[0, ids.shape[1]:]
    assert out.token_ids == ref.tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_random_weight_models_generate(tiny_models, arch):
    with LLM(tiny_models[arch]) as llm:
        out = llm.generate("hello there", SamplingParams.greedy(max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"


NEW = ["mistral", "phi3", "gemma2", "gemma3", "qwen3moe", "qwen2moe", "mixtral"]  # the families beyond Llama/Qwen
PROMPTS = ["The three primary colors are", "def fibonacci(n):\n    if n <= 1:",
           "Once upon a time, in a land far away, there lived a king who had three daughters and"]


@pytest.mark.parametrize("arch", NEW)
def test_greedy_generation_matches_transformers(tiny_models, arch):
    """The engine's greedy tokens (dequantised fp32) are transformers' for 40 tokens on each
    prompt; the longest prompt and the answers run well past the sliding window."""
    folder = tiny_models[arch]
    params = SamplingParams.greedy(max_tokens=40, ignore_eos=True)
    with LLM(folder, weights="dequantized") as llm:
        outs = llm.generate(PROMPTS, params)
        ids = [llm.tokenizer(p).input_ids for p in PROMPTS]
    assert max(len(i) for i in ids) > WINDOW
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for out, prompt_ids in zip(outs, ids):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=40, min_new_tokens=40, do_sample=False,
                              pad_token_id=0)[0, len(prompt_ids):]
        assert out.token_ids == ref.tolist()


@pytest.mark.parametrize("arch", NEW)
def test_gguf_blocks_agree_with_fp32(tiny_models, tmp_path, arch):
    """The GGUF-block path (Q8_0, 8-bit activations) against the fp32 values of the same file:
    the same next token at >= 98 % of teacher-forced positions where fp32's top two differ by
    more than 0.005 (random weights give flat logits: the median gap is about 0.02; measured,
    every disagreement sits at a gap under 0.005: 3, 1 and 1 of 80 positions for Gemma 2 (its
    final soft-cap of 3 flattens further), Gemma 3 and Mistral, 6 for Qwen3-MoE, whose router
    can pick another expert when two score alike)."""
    from gguf import GGMLQuantizationType as GGML
    from gguf_models import quantized_copy
    folder = quantized_copy(tiny_models[arch], tmp_path, GGML.Q8_0)
    ids = torch.randint(0, 1000, (80,), generator=torch.Generator().manual_seed(2)).tolist()
    q, f = our_logits(folder, ids, 60, "gguf"), our_logits(folder, ids, 60)
    top2 = f.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 0.005
    same = q.argmax(-1) == f.argmax(-1)
    assert same[clear].float().mean() >= 0.98 and same.float().mean() >= 0.9, (same.sum(), clear.sum())


@pytest.fixture(scope="module")
def wide_llama(smollm_dir, tmp_path_factory):
    """A random llama whose rows are multiples of 256 (the K types' super-blocks)."""
    tok = transformers.AutoTokenizer.from_pretrained(smollm_dir)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("wide-llama")
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("qtype", ["Q3_K", "IQ4_NL", "Q2_K", "IQ4_XS"])
def test_the_low_bit_types_run_on_blocks(wide_llama, tmp_path, qtype):
    """A GGUF whose every matrix is Q3_K, IQ4_NL, Q2_K or IQ4_XS (the low-bit types people
    bring to fit RAM) loads on the kernel's blocks in that type and agrees with the fp32 copy
    of the same file."""
    from gguf import GGMLQuantizationType as GGML
    from gguf_models import quantized_copy
    folder = quantized_copy(wide_llama, tmp_path, GGML[qtype])
    model = load_model(folder, CPU, torch.float32, "gguf")
    kinds = {p.qtype.name for m in model.modules() if isinstance(m, QuantLinear) for p in m.parts}
    assert kinds == {qtype}
    ids = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    q, f = our_logits(folder, ids, 30, "gguf"), our_logits(folder, ids, 30)
    assert torch.nn.functional.cosine_similarity(q, f, dim=-1).min() > 0.999
    # The top token may differ only where fp32's top two are closer than twice the largest
    # logit error (8-bit activations; measured for Q3_K: 1 of 39 positions, gap 0.006, error 0.02).
    top2 = f.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 2 * (q - f).abs().max()
    assert torch.equal(q.argmax(-1)[clear], f.argmax(-1)[clear]) and clear.float().mean() > 0.5


@pytest.mark.parametrize("qtype", ["MXFP4"])
def test_a_type_without_a_kernel_is_named(wide_llama, tmp_path, qtype):
    from gguf import GGMLQuantizationType as GGML
    from gguf_models import quantized_copy
    from ssd.errors import UnsupportedModelError
    folder = quantized_copy(wide_llama, tmp_path, GGML[qtype])
    with pytest.raises(UnsupportedModelError, match=f"GGUF type {qtype} .*weights='dequantized'"):
        load_model(folder, CPU, torch.float32, "gguf")
    assert load_model(folder, CPU, torch.float32, "dequantized") is not None


@pytest.mark.parametrize("qtype", ["F16", "BF16"])
def test_half_matrices_stay_half_and_give_the_fp32_copys_bits(wide_llama, tmp_path, qtype):
    """A GGUF of F16 / BF16 matrices on the blocks path holds them in their own dtype (half the
    bytes of an fp32 copy), read by the linear kernel as their fp32 values: the logits of the
    fp32 copy, bit for bit."""
    from gguf import GGMLQuantizationType as GGML
    from gguf_models import quantized_copy
    from ssd.layers.linear import Linear
    folder = quantized_copy(wide_llama, tmp_path, GGML[qtype])
    model = load_model(folder, CPU, torch.float32, "gguf")
    dtypes = {m.weight.dtype for m in model.modules() if isinstance(m, Linear)}
    assert dtypes == {torch.float16 if qtype == "F16" else torch.bfloat16}
    ids = torch.randint(0, 1000, (24,), generator=torch.Generator().manual_seed(4)).tolist()
    assert torch.equal(our_logits(folder, ids, 16, "gguf"), our_logits(folder, ids, 16))
