"""Models by Hugging Face hub id (ssd/hub.py, docs/models.md). No hub is reachable here: each
test lays out huggingface_hub's cache (models--org--name/refs, snapshots/<commit>/ linking
into blobs/) in a temporary HF_HOME, with small random models, and sets HF_HUB_OFFLINE."""
import hashlib
import os
from pathlib import Path

import gguf
import huggingface_hub
import pytest
import torch
import transformers

from ssd import LLM, SamplingParams, cli, hub, store
from ssd.errors import ModelNotFoundError
from ssd.models.names import GGUF_LINK
from tiny_pair import NEW, PROMPT

MAIN, DEV = "a" * 40, "b" * 40  # two commits of one repository
GREEDY = SamplingParams.greedy(max_tokens=NEW, ignore_eos=True)


def cache_snapshot(hf_home: Path, repo: str, commit: str, files: dict[str, Path], ref: str | None = None) -> Path:
    """`files` (name in the repository -> a file here) as the hub cache holds `repo` at
    `commit`: each blob under its hash, the snapshot's files links to the blobs, refs/<ref>
    naming the commit."""
    root = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    for name, src in files.items():
        data = src.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref is not None:
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return snapshot


def folder_files(folder: Path) -> dict[str, Path]:
    return {f.name: f for f in folder.iterdir() if f.is_file()}


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # A store of its own for the prepared GGUF folders, with the built kernels of the real one.
    kernels = store.store_root() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (tmp_path / "ssd").mkdir()
    (tmp_path / "ssd" / "kernels").symlink_to(kernels)
    monkeypatch.setenv("SSD_HOME", str(tmp_path / "ssd"))
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hub, "_fetched", {})
    return home


@pytest.fixture(scope="module")
def tiny_ggufs(smollm_dir, tmp_path_factory) -> dict[str, Path]:
    """A random 2-layer Llama over SmolLM2's vocabulary as two self-contained GGUF files."""
    from gguf_models import quantized_copy
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    out = {}
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0):
        out[qtype.name] = quantized_copy(folder, tmp_path_factory.mktemp(qtype.name), qtype, metadata=True) \
            / "weights.gguf"
    return out


def greedy(model, **kw) -> list[int]:
    with LLM(model, **kw) as llm:
        return llm.generate(PROMPT, GREEDY)[0].token_ids


def test_a_hub_id_loads_its_cached_snapshot_and_revision_picks_another(hf_home, tiny_pair):
    target, draft = tiny_pair
    main = cache_snapshot(hf_home, "org/tiny", MAIN, folder_files(target), ref="main")
    dev = cache_snapshot(hf_home, "org/tiny", DEV, folder_files(draft), ref="dev")
    assert store.resolve_model("org/tiny") == main
    assert store.resolve_model("org/tiny@dev") == store.resolve_model(f"org/tiny@{DEV}") == dev
    assert greedy("org/tiny") == greedy(target)
    assert greedy("org/tiny@dev") == greedy(draft)
    # As a draft too: SD with the hub ids gives the target's tokens.
    assert greedy("org/tiny", draft="org/tiny@dev", mode="sd", speculate_k=3) == greedy(target)


def test_a_tag_picks_a_gguf_file(hf_home, tiny_ggufs):
    q8, q4 = tiny_ggufs["Q8_0"], tiny_ggufs["Q4_0"]
    cache_snapshot(hf_home, "org/tiny-GGUF", MAIN, {"tiny-Q8_0.gguf": q8, "Tiny-Q4_K_M.gguf": q4,
                                                    "tiny-Q4_K_S.gguf": q8, "mmproj-tiny-f16.gguf": q8}, ref="main")
    for spec in ("org/tiny-GGUF:Q4_K_M", "org/tiny-GGUF:q4_k_m", "org/tiny-GGUF", "org/tiny-GGUF:tiny-q4_k_m.gguf"):
        folder = store.resolve_model(spec)
        assert folder.parent == store.store_root() / "prepared" and folder.name.startswith("Tiny-Q4_K_M-"), spec
        assert (folder / GGUF_LINK).resolve().read_bytes() == q4.read_bytes()
    assert store.resolve_model("org/tiny-GGUF:Q8_0").name.startswith("tiny-Q8_0-")
    assert greedy("org/tiny-GGUF:Q4_K_M") == greedy(q4)
    for tag, says in (("Q4_K", "matches none"), ("tiny", "matches several"), ("Q5_0", "matches none")):
        with pytest.raises(ModelNotFoundError, match=says) as e:
            store.resolve_model(f"org/tiny-GGUF:{tag}")
        assert "tiny-Q8_0.gguf" in str(e.value) or tag == "tiny"


def test_a_safetensors_snapshot_fetches_only_the_model_files(hf_home, tiny_pair, tiny_ggufs):
    """A repository holding safetensors and GGUF files: the id alone is the safetensors folder."""
    target, _ = tiny_pair
    files = {**folder_files(target), "tiny-Q8_0.gguf": tiny_ggufs["Q8_0"], "README.md": target / "config.json"}
    snapshot = cache_snapshot(hf_home, "org/both", MAIN, files, ref="main")
    picked = hub._pick(hub.parse("org/both"), sorted(files), from_cache=True)
    assert "README.md" not in picked and "tiny-Q8_0.gguf" not in picked
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(picked)
    assert store.resolve_model("org/both") == snapshot
    assert store.resolve_model("org/both:Q8_0").name.startswith("tiny-Q8_0-")


def test_a_model_missing_offline_is_one_clear_error(hf_home, capsys):
    with pytest.raises(ModelNotFoundError) as e:
        store.resolve_model("org/absent@v2")
    text = str(e.value)
    for part in ("'org/absent@v2'", str(hf_home / "hub"), "HF_HUB_OFFLINE", "by its path"):
        assert part in text, part
    assert cli.main(["generate", "--model", "org/absent", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ssd: error: model 'org/absent' is not in the Hugging Face cache") and "Traceback" not in err
    assert err.count("\n") == 1


def test_an_unreachable_hub_falls_back_to_the_cache(hf_home, tiny_pair, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    asked = []

    def unreachable(self, repo_id, **kw):
        asked.append(repo_id)
        raise ConnectionError("no route to host")
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", unreachable)
    main = cache_snapshot(hf_home, "org/tiny", MAIN, folder_files(tiny_pair[0]), ref="main")
    assert store.resolve_model("org/tiny") == main and store.resolve_model("org/tiny") == main
    assert asked == ["org/tiny"]  # once a process
    with pytest.raises(ModelNotFoundError, match=r"could not be reached \(ConnectionError: no route to host\)"
                                                 r".*Connect to download it"):
        store.resolve_model("org/absent")


def test_online_only_the_picked_files_are_downloaded(hf_home, monkeypatch, tmp_path):
    """With the hub reachable (here: huggingface_hub's calls replaced), the repository's list
    decides what is fetched, and the download may use the network."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    listing = ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
               "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "README.md",
               "onnx/model.onnx", "original/consolidated.safetensors", "x-Q8_0.gguf", "x-Q4_K_M.gguf"]
    calls = []
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", lambda self, repo_id, revision=None: listing)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda **kw: calls.append(kw) or str(tmp_path))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda **kw: calls.append(kw) or "/x/x-Q8_0.gguf")
    assert hub.fetch(hub.parse("org/big@v2")) == tmp_path
    assert hub.fetch(hub.parse("org/big:Q8_0"), force=True) == Path("/x/x-Q8_0.gguf")
    folder, gguf_file = calls
    assert sorted(folder.pop("allow_patterns")) == sorted(listing[:6])
    assert folder == dict(repo_id="org/big", revision="v2", cache_dir=hf_home / "hub", local_files_only=False,
                          force_download=False)
    assert gguf_file == dict(repo_id="org/big", revision=None, cache_dir=hf_home / "hub", local_files_only=False,
                             force_download=True, filename="x-Q8_0.gguf")


def test_pull_takes_a_hub_id(hf_home, tiny_pair, capsys):
    main = cache_snapshot(hf_home, "org/tiny", MAIN, folder_files(tiny_pair[0]), ref="main")
    assert cli.main(["pull", "org/tiny"]) == 0
    assert capsys.readouterr().out == f"org/tiny: {main}\n"


def test_names_and_paths_are_not_hub_ids(tmp_path, monkeypatch, smollm_dir):
    assert hub.parse("org/name@v1.0:Q4_K_M") == hub.HubRef("org/name", "v1.0", "Q4_K_M")
    for spec in ("smollm2-135m-instruct", "./org/name", "/org/name", "~/org/name", "org/model.gguf", "a/b/c"):
        assert hub.parse(spec) is None, spec
    assert store.resolve_model("smollm2-135m-instruct") == smollm_dir  # a store name resolves as before
    (tmp_path / "org" / "name").mkdir(parents=True)
    (tmp_path / "org" / "name" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert store.resolve_model("org/name") == Path("org/name")  # a folder here wins over the hub
