"""EAGLE-3 heads load as people bring them (ssd/speculative/draft/eagle.py): random-weight heads
written here in exactly the EAGLE-3 authors' layout (pytorch_model.bin or model.safetensors)
and in vLLM's speculators layout, for a Llama-shaped (SmolLM2) and a Qwen2-shaped target."""
import json

import pytest
import torch
from safetensors.torch import save_file

from ssd.errors import ModelFileError, SSDError, UnsupportedModelError
from ssd.models.config import ModelConfig
from ssd.models.loader import load_model
from ssd.runner.kv_cache import PagedKVCache
from ssd.runner.model_runner import Chunk, ModelRunner
from ssd.layers.attention import AttentionBatch
from ssd.speculative.draft.eagle import EagleConfig, EagleHead, expected_shapes, load_eagle

QWEN = ModelConfig.from_dict({"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
                              "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                              "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                              "max_position_embeddings": 32768, "tie_word_embeddings": True})
VD = 64  # the head's own vocabulary


def layer_config(target: ModelConfig) -> dict:
    return {"hidden_size": target.hidden_size, "intermediate_size": 2 * target.hidden_size,
            "num_attention_heads": target.num_heads, "num_key_value_heads": target.num_kv_heads,
            "rms_norm_eps": 1e-5, "vocab_size": target.vocab_size, "max_position_embeddings": 2048}


def used_tokens(target: ModelConfig, vd: int = VD) -> torch.Tensor:
    return torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(0))[:vd].sort().values


def head_tensors(target: ModelConfig, vd: int = VD) -> dict[str, torch.Tensor]:
    """A head's tensors in the authors' names, random, with its d2t / t2d."""
    cfg = EagleConfig._layer(layer_config(target), {"draft_vocab_size": vd}, "eagle3", None, None, False, None)
    g = torch.Generator().manual_seed(1)
    tensors = {n: 0.1 * torch.randn(shape, generator=g) for n, shape in expected_shapes(cfg).items()}
    ids = used_tokens(target, vd)
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return {**tensors, "d2t": ids - torch.arange(vd), "t2d": t2d}


def write_authors(folder, target: ModelConfig, weights: str = "pytorch_model.bin", **config) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = head_tensors(target)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                    "num_hidden_layers": 1, "hidden_act": "silu",
                                                    "draft_vocab_size": VD, **layer_config(target), **config}))
    if weights.endswith(".bin"):
        torch.save(tensors, folder / weights)
    else:
        save_file(tensors, folder / weights)
    return tensors


def write_speculators(folder, target: ModelConfig, layer_ids=None, embed: bool = False, vd: int = VD,
                      **flags) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = head_tensors(target, vd)
    renamed = {n.replace("midlayer.", "layers.0."): t for n, t in tensors.items()}
    if embed:
        renamed["embed_tokens.weight"] = torch.randn(target.vocab_size, target.hidden_size)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.2.0",
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                               "verifier": {"name_or_path": "target", "architectures": ["Qwen2ForCausalLM"]}},
        "transformer_layer_config": {"model_type": "llama", **layer_config(target)}, "draft_vocab_size": vd,
        "norm_before_residual": False, "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": layer_ids,
        "norm_before_fc": False, "fc_norm": False, "norm_output": False, **flags}))
    save_file(renamed, folder / "model.safetensors")
    return tensors


@pytest.fixture(scope="module")
def smollm_config(smollm_dir):
    return ModelConfig.from_folder(smollm_dir)


@pytest.mark.parametrize("weights", ["pytorch_model.bin", "model.safetensors"])
def test_the_authors_layout_loads(tmp_path, smollm_config, weights):
    written = write_authors(tmp_path / "head", smollm_config, weights)
    head = load_eagle(tmp_path / "head", smollm_config)
    assert head.config.layout == "eagle3" and head.embedding is None and head.config.rope_theta == 10000.0
    assert head.config.target_layers(smollm_config.num_layers) == (2, 15, 27)
    assert set(head.tensors) == set(expected_shapes(head.config))
    assert all(torch.equal(head.tensors[n], written[n]) for n in head.tensors)
    assert torch.equal(head.draft_to_target, used_tokens(smollm_config))  # token i is the target's i + d2t[i]


def test_the_speculators_layout_loads_to_the_same_head(tmp_path):
    written = write_speculators(tmp_path / "spec", QWEN, layer_ids=[1, 12, 20], embed=True)
    head = load_eagle(tmp_path / "spec", QWEN)
    assert head.config.layout == "speculators" and head.config.target_layers(QWEN.num_layers) == (1, 12, 20)
    assert all(torch.equal(head.tensors[n], written[n]) for n in head.tensors)
    assert head.embedding.shape == (QWEN.vocab_size, QWEN.hidden_size)
    write_authors(tmp_path / "authors", QWEN, "model.safetensors")
    authors = load_eagle(tmp_path / "authors", QWEN)
    assert torch.equal(authors.draft_to_target, head.draft_to_target)
    assert all(torch.equal(authors.tensors[n], head.tensors[n]) for n in head.tensors)


def test_a_head_for_another_target_is_refused_naming_the_mismatch(tmp_path, smollm_config):
    write_authors(tmp_path / "qwen-head", QWEN)
    with pytest.raises(UnsupportedModelError) as e:
        load_eagle(tmp_path / "qwen-head", smollm_config)
    assert "width 896" in str(e.value) and "vocabulary of 151936" in str(e.value)
    write_speculators(tmp_path / "deep", QWEN, layer_ids=[2, 12, 30])
    with pytest.raises(UnsupportedModelError, match=r"target layers \[2, 12, 30\], the target has 24"):
        load_eagle(tmp_path / "deep", QWEN)


def test_bad_files_are_clear_errors(tmp_path, smollm_config):
    folder = tmp_path / "head"
    tensors = write_authors(folder, smollm_config)
    del tensors["norm.weight"]
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:-1]
    torch.save(tensors, folder / "pytorch_model.bin")
    with pytest.raises(ModelFileError, match=r"missing \['norm.weight'\].*lm_head.weight is \(63, 576\)"):
        load_eagle(folder, smollm_config)
    tensors = write_authors(folder, smollm_config)
    tensors["t2d"][0] = not bool(tensors["t2d"][0])
    torch.save(tensors, folder / "pytorch_model.bin")
    with pytest.raises(ModelFileError, match="t2d does not mark"):
        load_eagle(folder, smollm_config)
    tensors["d2t"][1] = -1  # token 1 maps to 0: not rising
    torch.save(tensors, folder / "pytorch_model.bin")
    with pytest.raises(ModelFileError, match="d2t does not map"):
        load_eagle(folder, smollm_config)
    write_speculators(tmp_path / "flags", QWEN, norm_before_fc=True)
    with pytest.raises(UnsupportedModelError, match="norm_before_fc"):
        load_eagle(tmp_path / "flags", QWEN)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelFileError, match="not an EAGLE-3 head"):
        load_eagle(tmp_path / "plain", smollm_config)
    (folder / "pytorch_model.bin").unlink()
    with pytest.raises(ModelFileError, match="no weights"):
        load_eagle(folder, smollm_config)


def test_a_pass_returns_the_states_entering_the_layers_a_head_reads(smollm_dir):
    """The target's pass gives the residual stream entering chosen layers beside its logits,
    from the layers as one CPU op and from the Python loop with the same bits, and taking them
    changes nothing of the logits: layer 0's is the embedding, layer L's the stream the final
    norm and head turn into the logits."""
    model = load_model(smollm_dir, torch.device("cpu"), torch.float32, "gguf")
    L = model.config.num_layers
    taps = (0, *EagleConfig._layer(layer_config(QWEN), {"draft_vocab_size": VD}, "eagle3", None, None, False,
                                   None).target_layers(L), L)
    ids = torch.randint(0, model.config.vocab_size, (26,), generator=torch.Generator().manual_seed(5)).tolist()
    out = {}
    for fused in (True, False):
        model.fused_layers = fused
        for tapped in (True, False):
            cache = PagedKVCache(model.config, 256, 16, torch.device("cpu"), torch.float32)
            runner = ModelRunner(model, cache, torch.device("cpu"))
            cache.reserve(0, 26)
            kw = dict(taps=taps) if tapped else {}
            out[fused, tapped] = [runner.forward([Chunk(0, ids[:20], 0, 20)], **kw),
                                  runner.forward([Chunk(0, ids[20:26], 20, 3)], **kw)]  # a verify pass's last rows
    (logits, states), (verify, verify_states) = out[True, True]
    assert states.shape == (len(taps), 20, model.config.hidden_size) and verify_states.shape[1] == 6  # every row
    for fused in (True, False):
        assert torch.equal(out[fused, True][0][0], out[fused, False][0]) and torch.equal(out[fused, True][1][0],
                                                                                          out[fused, False][1])
        for (a, sa), (b, sb) in zip(out[fused, True], out[True, True]):
            assert torch.equal(a, b) and torch.equal(sa, sb)
    assert torch.equal(states[0], model.embed_tokens(torch.tensor(ids[:20])))
    assert torch.equal(model.logits(model.norm(states[-1])), logits)
    cache = PagedKVCache(model.config, 64, 16, torch.device("cpu"), torch.float32)
    cache.reserve(0, 4)
    with pytest.raises(SSDError, match="ascending layer ids"):
        ModelRunner(model, cache, torch.device("cpu")).forward([Chunk(0, ids[:4], 0, 1)], taps=(5, 2))


def reference_step(w: dict, cfg: EagleConfig, embed: torch.Tensor, tokens: torch.Tensor, h: torch.Tensor):
    """The authors' layer in plain torch (eagle/model/cnets.py, written apart from the engine):
    h [T, H], each row's input state (the target's through fc, or the head's own); causal
    attention over the rows, rotate-half RoPE at positions 0..T-1 with the config's base."""
    def rms(x, g):
        return g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps))
    t, hd = len(tokens), cfg.head_dim
    x = torch.cat([rms(embed[tokens], w["midlayer.input_layernorm.weight"]),
                   rms(h, w["midlayer.hidden_norm.weight"])], dim=-1)
    q, k, v = (x @ w[f"midlayer.self_attn.{p}_proj.weight"].T for p in "qkv")
    q, k, v = q.view(t, -1, hd), k.view(t, -1, hd), v.view(t, -1, hd)
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd)
    freqs = torch.arange(t).float()[:, None] * inv[None]
    cos, sin = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat([freqs, freqs], -1).sin()[:, None]
    rotate = lambda y: torch.cat([-y[..., hd // 2:], y[..., :hd // 2]], -1)  # noqa: E731
    q, k = q * cos + rotate(q) * sin, k * cos + rotate(k) * sin
    group = cfg.num_heads // cfg.num_kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * hd ** -0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, -1) @ w["midlayer.self_attn.o_proj.weight"].T
    h = h + o
    m = rms(h, w["midlayer.post_attention_layernorm.weight"])
    gate, up = m @ w["midlayer.mlp.gate_proj.weight"].T, m @ w["midlayer.mlp.up_proj.weight"].T
    h = h + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
    return rms(h, w["norm.weight"]) @ w["lm_head.weight"].T, h


def test_the_head_computes_the_authors_layer(tmp_path, smollm_config):
    """A random head in the engine's layers (paged KV cache, batch-invariant kernels) against the
    authors' arithmetic written out in plain torch: the target's states through fc, then the
    head's own output state fed back as the next step's input, from the cache."""
    written = write_authors(tmp_path / "head", smollm_config)
    weights = load_eagle(tmp_path / "head", smollm_config)
    cfg = weights.config
    table = torch.randn(smollm_config.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    head = EagleHead(weights, torch.nn.Embedding.from_pretrained(table), max_positions=64)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, smollm_config.vocab_size, (6,), generator=g)
    states = torch.randn(6, 3 * cfg.target_hidden_size, generator=g)
    kv = torch.zeros(2, 16, cfg.num_kv_heads, cfg.head_dim)
    rows = torch.arange(16)[None]

    def batch(positions):
        return AttentionBatch(positions.clone(), rows, torch.zeros(len(positions), dtype=torch.long), positions + 1)
    first = torch.arange(5)
    logits, out = head(tokens[:5], states[:5], first, batch(first), kv)
    fed = states[:5] @ written["fc.weight"].T
    want_logits, want_out = reference_step(written, cfg, table, tokens[:5], fed)
    assert torch.allclose(logits, want_logits, atol=1e-3, rtol=1e-4) and torch.allclose(out, want_out, atol=1e-4)
    # The next step reads the head's own last state (width H, no fc) at position 5, and the
    # cached keys of rows 0..4: the reference's sixth row over all six.
    step_logits, _ = head(tokens[5:], out[-1:], torch.tensor([5]), batch(torch.tensor([5])), kv)
    want_logits, _ = reference_step(written, cfg, table, tokens, torch.cat([fed, want_out[-1:]]))
    assert torch.allclose(step_logits[0], want_logits[5], atol=1e-3, rtol=1e-4)
    assert set(head.draft_to_target[logits.argmax(-1)].tolist()) <= set(used_tokens(smollm_config).tolist())
