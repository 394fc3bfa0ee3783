"""Model store and GGUF conversion. Uses the real store ($SSD_HOME or ~/.cache/ssd-engine):
SmolLM2 is pulled there once (~93 MB) and reused by later runs."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from ssd import store
from ssd.errors import ModelFileError, ModelNotFoundError, UnsupportedModelError
from ssd.gguf_convert import convert_gguf

SMOL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smol() -> Path:
    return store.resolve_model(SMOL)


def assert_same_as_transformers(folder: Path, gguf: Path, names: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    ref_sd = ref.state_dict()
    with safe_open(str(folder / "model.safetensors"), framework="pt") as st:
        keys = set(st.keys())
        tied = ref.config.tie_word_embeddings
        assert keys == set(ref_sd) - ({"lm_head.weight"} if tied else set())
        for name in names or sorted(keys):
            mine = st.get_tensor(name)
            assert mine.dtype == torch.float32 and mine.shape == ref_sd[name].shape, name
            # Bit-identical, not just close: compare the raw bits.
            assert torch.equal(mine.view(torch.int32), ref_sd[name].view(torch.int32)), name


def test_pull_gives_hf_folder(smol: Path) -> None:
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json"):
        assert (smol / f).is_file(), f
    cfg = json.loads((smol / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert cfg["tie_word_embeddings"] is True and cfg["eos_token_id"] == 2
    assert "quantization_config" not in cfg
    listed = {m["name"]: m for m in store.list_models()}
    assert listed[SMOL]["present"] and listed[SMOL]["path"] == smol
    assert store.resolve_model(SMOL) == smol


def test_weights_bit_identical_to_transformers(smol: Path) -> None:
    assert_same_as_transformers(smol, store.gguf_path(SMOL))


def test_chat_template_renders_chatml(smol: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smol))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2


def test_unknown_name_lists_known_models() -> None:
    with pytest.raises(ModelNotFoundError) as e:
        store.resolve_model("no-such-model")
    assert all(name in str(e.value) for name in store.REGISTRY)


def test_no_pull_when_not_allowed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SSD_HOME", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="not in the store"):
        store.resolve_model(SMOL, pull=False)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_file_is_rejected_and_deleted(smol: Path, tmp_path: Path, damage: str) -> None:
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(store.gguf_path(SMOL), copy)
    store.verify_file(copy, SMOL)
    with open(copy, "r+b") as f:
        if damage == "flip":
            f.seek(12345)
            b = f.read(1)
            f.seek(12345)
            f.write(bytes([b[0] ^ 1]))
        else:
            f.truncate(1000)
    with pytest.raises(ModelFileError, match="sha256") as e:
        store.verify_file(copy, SMOL)
    assert store.REGISTRY[SMOL].sha256 in str(e.value)
    assert not copy.exists()


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="config.json"):
        store.resolve_model(tmp_path)


def test_model_folder_returned_as_is(smol: Path) -> None:
    assert store.resolve_model(str(smol)) == smol


def test_gguf_path_converted_once(smol: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "SmolLM2.gguf"
    gguf.symlink_to(store.gguf_path(SMOL))
    monkeypatch.setenv("SSD_HOME", str(tmp_path / "home"))
    calls = []

    def counting_convert(*args):
        calls.append(args)
        return convert_gguf(*args)

    monkeypatch.setattr(store, "convert_gguf", counting_convert)
    first = store.resolve_model(gguf)
    # Named after the symlink's target: the key is the real file's path, size and mtime.
    assert first.parent == tmp_path / "home" / "converted" and first.name.startswith(f"{SMOL}-")
    assert store.resolve_model(str(gguf)) == first
    assert len(calls) == 1
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name]  # no temp folder left
    with safe_open(str(first / "model.safetensors"), framework="pt") as a, \
            safe_open(str(smol / "model.safetensors"), framework="pt") as b:
        assert set(a.keys()) == set(b.keys())
        assert torch.equal(a.get_tensor("model.layers.0.self_attn.q_proj.weight"),
                           b.get_tensor("model.layers.0.self_attn.q_proj.weight"))


def test_unsupported_arch(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"])
def test_qwen_bit_identical_and_chatml(name: str) -> None:
    from transformers import AutoTokenizer

    folder = store.resolve_model(name)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["tie_word_embeddings"] is False
    assert cfg["eos_token_id"] == 151645 and cfg["vocab_size"] == 151936
    last = cfg["num_hidden_layers"] - 1
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{p}" for i in (0, last) for p in (
            "self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight",
            "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
            "input_layernorm.weight", "post_attention_layernorm.weight")]
    assert_same_as_transformers(folder, store.gguf_path(name), names)
    tok = AutoTokenizer.from_pretrained(str(folder))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
