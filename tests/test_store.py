"""Model store and GGUF files. Uses the real store ($SSD_HOME or ~/.cache/ssd-engine): SmolLM2 is
pulled there once (~93 MB) and reused by later runs; tests that change a store use a copy."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from ssd import LLM, store
from ssd.errors import ModelFileError, ModelNotFoundError, UnsupportedModelError
from ssd.models.gguf_file import open_gguf, prepare_folder
from ssd.models.names import GGUF_LINK
from ssd.models.loader import read_weights, transformers_kwargs

SMOL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smol() -> Path:
    return store.resolve_model(SMOL)


def assert_same_as_transformers(folder: Path, names: list[str] | None = None) -> None:
    """The fp32 values the engine reads from the GGUF (weights='dequantized') are the bits
    transformers loads from the same file."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **transformers_kwargs(folder))
    ref_sd = ref.state_dict()
    mine = read_weights(folder)
    tied = ref.config.tie_word_embeddings
    assert set(mine) == set(ref_sd) - ({"lm_head.weight"} if tied else set())
    for name in names or sorted(mine):
        assert mine[name].dtype == torch.float32 and mine[name].shape == ref_sd[name].shape, name
        # Bit-identical, not just close: compare the raw bits.
        assert torch.equal(mine[name].view(torch.int32), ref_sd[name].view(torch.int32)), name


def test_pull_gives_a_model_folder_without_weight_copies(smol: Path) -> None:
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (smol / f).is_file(), f
    assert (smol / GGUF_LINK).resolve() == store.gguf_path(SMOL).resolve()
    assert not list(smol.glob("*.safetensors")), "no fp32 conversion is written"
    cfg = json.loads((smol / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert cfg["tie_word_embeddings"] is True and cfg["eos_token_id"] == 2
    assert "quantization_config" not in cfg
    listed = {m["name"]: m for m in store.list_models()}
    assert listed[SMOL]["present"] and listed[SMOL]["path"] == smol
    assert store.resolve_model(SMOL) == smol


def test_dequantized_weights_bit_identical_to_transformers(smol: Path) -> None:
    assert_same_as_transformers(smol)


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


def test_gguf_path_prepared_once(smol: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf_file = tmp_path / "SmolLM2.gguf"
    gguf_file.symlink_to(store.gguf_path(SMOL))
    monkeypatch.setenv("SSD_HOME", str(tmp_path / "home"))
    calls = []

    def counting_prepare(*args):
        calls.append(args)
        return prepare_folder(*args)

    monkeypatch.setattr(store, "_prepare", counting_prepare)
    first = store.resolve_model(gguf_file)
    # Named after the symlink's target: the key is the real file's path, size and mtime.
    assert first.parent == tmp_path / "home" / "prepared" and first.name.startswith(f"{SMOL}-")
    assert store.resolve_model(str(gguf_file)) == first
    assert len(calls) == 1
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name]  # no temp folder left
    assert (first / GGUF_LINK).resolve() == gguf_file.resolve()


def _store_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty store holding only SmolLM2's checked GGUF (nothing to download)."""
    home = tmp_path / "home"
    (home / "gguf").mkdir(parents=True)
    shutil.copyfile(store.gguf_path(SMOL), home / "gguf" / f"{SMOL}.gguf")
    monkeypatch.setenv("SSD_HOME", str(home))
    return home


@pytest.mark.long  # a single pull's checks stay in CI
def test_two_pulls_at_once_leave_a_complete_store(smol: Path, tmp_path: Path, monkeypatch) -> None:
    home = _store_copy(tmp_path, monkeypatch)
    cmd = [sys.executable, "-m", "ssd.cli", "pull", SMOL]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    folder = home / "models" / SMOL
    assert store._is_complete(folder) and sorted(p.name for p in (home / "models").iterdir()) == [SMOL]
    with LLM(SMOL) as llm:
        assert llm.generate("Hi", __import__("ssd").SamplingParams.greedy(max_tokens=2))[0].token_ids


def test_an_interrupted_preparation_is_never_used(smol: Path, tmp_path: Path, monkeypatch) -> None:
    """A pull killed while writing the folder leaves a temporary folder, or (before this
    engine's layout) a folder of fp32 copies without the GGUF link: neither counts as the
    model; the next use prepares it again and cleans up."""
    home = _store_copy(tmp_path, monkeypatch)
    folder = home / "models" / SMOL
    (home / "models" / f".{SMOL}.tmp-12345").mkdir(parents=True)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text((smol / "config.json").read_text())
    (folder / "model.safetensors").write_bytes(b"an fp32 copy from an older version")
    assert not store._is_complete(folder)
    assert store.resolve_model(SMOL) == folder
    assert store._is_complete(folder) and not list(folder.glob("*.safetensors"))


def _tiny_gguf(path: Path, *, arch: str = "llama", rows: int = 4, claim: int | None = None) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", np.zeros((rows, 8), dtype=np.float32))
    if claim is not None:  # a tensor that claims far more data than the file holds
        writer.add_tensor_info("output.weight", (claim, 8), np.dtype(np.float32), claim * 32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file() if claim is not None else writer.write_tensors_to_file()
    if claim is not None:
        writer.write_tensor_data(np.zeros((rows, 8), dtype=np.float32))
    writer.close()
    return path


def test_unsupported_arch(tmp_path: Path) -> None:
    path = _tiny_gguf(tmp_path / "tiny.gguf", arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        prepare_folder(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["magic", "truncated", "absurd size", "empty"])
def test_bad_gguf_files_are_clear_errors(smol: Path, tmp_path: Path, damage: str) -> None:
    path = tmp_path / "bad.gguf"
    if damage == "magic":
        path.write_bytes(b"GGML" + store.gguf_path(SMOL).read_bytes()[4:4096])
    elif damage == "truncated":
        with open(store.gguf_path(SMOL), "rb") as f:
            path.write_bytes(f.read(40_000_000))  # the header and some of the tensors
    elif damage == "absurd size":
        _tiny_gguf(path, claim=2**40)  # 32 TiB announced: must not be allocated
    else:
        path.write_bytes(b"")
    with pytest.raises(ModelFileError, match="cannot read GGUF file"):
        open_gguf(path)
    with pytest.raises(ModelFileError):
        LLM(path)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"])
def test_qwen_bit_identical_and_chatml(name: str) -> None:
    from transformers import AutoTokenizer

    folder = store.resolve_model(name)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["tie_word_embeddings"] is False
    assert cfg["eos_token_id"] == 151645 and cfg["vocab_size"] == 151936
    assert_same_as_transformers(folder)
    tok = AutoTokenizer.from_pretrained(str(folder))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
