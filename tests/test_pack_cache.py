"""The packed matrices kept on disk after a model's first load (ssd/models/pack_cache.py): a
later load reads them instead of repacking, with the same bits; a change of file or options,
a file cut short or SSD_PACK_CACHE=0 falls back to repacking."""
import os

import pytest
from gguf import GGMLQuantizationType as GGML

from ssd import LLM, SamplingParams
from ssd.kernels import quant_cpu
from ssd.models import pack_cache

pytestmark = pytest.mark.skipif(not quant_cpu.available(), reason="needs the CPU quant kernel")

PROMPTS = ["The capital of France is", "def add(a, b):"]
PARAMS = SamplingParams.greedy(max_tokens=12, ignore_eos=True, logprobs=2)


@pytest.fixture
def counted(monkeypatch):
    """Every matrix is cached however small; repack calls are counted."""
    monkeypatch.setattr(pack_cache, "MIN_BYTES", 0)
    calls = []
    real = quant_cpu.repack

    def repack(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)
    monkeypatch.setattr(quant_cpu, "repack", repack)
    return calls


def run(folder, **kwargs) -> list:
    with LLM(folder, **kwargs) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
    pack_cache.wait()
    return [(o.token_ids, [(p.logprob, p.top) for p in o.logprobs]) for o in outs]


def cache_files(folder) -> list:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("packed-"))


@pytest.mark.parametrize("arch,qtype", [("qwen3moe", GGML.Q8_0), ("llama", GGML.IQ4_NL)])
def test_a_second_load_reads_the_kept_matrices_and_gives_the_same_bits(tiny_models, tmp_path, counted, arch, qtype):
    from gguf_models import quantized_copy
    folder = quantized_copy(tiny_models[arch], tmp_path / "m", qtype)
    first = run(folder)
    made = len(counted)
    assert made > 0 and len(cache_files(folder)) == 2  # the packed file and its index
    counted.clear()
    assert run(folder) == first
    assert counted == []  # nothing repacked: every matrix came from the file
    # A draft's requantisation is another set of matrices: a file of its own.
    run(folder, weights="q4_0")
    assert len(counted) >= made and len(cache_files(folder)) == 4


def test_a_file_cut_short_or_a_changed_model_is_repacked(tiny_models, tmp_path, counted):
    from gguf_models import quantized_copy
    folder = quantized_copy(tiny_models["llama"], tmp_path / "m", GGML.Q8_0)
    first = run(folder)
    made = len(counted)
    [bin_file] = [p for p in folder.iterdir() if p.suffix == ".bin"]
    with open(bin_file, "r+b") as f:
        f.truncate(bin_file.stat().st_size - 1)
    counted.clear()
    assert run(folder) == first and len(counted) == made
    assert bin_file.stat().st_size > 0 and len(cache_files(folder)) == 2  # written again, whole
    counted.clear()
    assert run(folder) == first and counted == []
    gguf_file = next(folder.glob("*.gguf"))
    os.utime(gguf_file, ns=(gguf_file.stat().st_atime_ns, gguf_file.stat().st_mtime_ns + 10**9))
    counted.clear()
    assert run(folder) == first and len(counted) == made  # another key: repacked
    assert len(cache_files(folder)) == 2  # the old file dropped


def test_a_deleted_models_kept_file_goes_with_the_next_save(tiny_models, tmp_path, counted):
    """A GGUF given by path gets a prepared folder (a link to it) in the store; once the file is
    deleted, the next cache file written in the store removes the orphan's."""
    from gguf_models import quantized_copy
    a = quantized_copy(tiny_models["llama"], tmp_path / "a", GGML.Q8_0)
    b = quantized_copy(tiny_models["llama"], tmp_path / "b", GGML.Q8_0)
    store = tmp_path / "prepared"
    for name, src in (("a", a), ("b", b)):
        (store / name).mkdir(parents=True)
        (store / name / "model.gguf").symlink_to(next(src.glob("*.gguf")))
        for f in src.iterdir():
            if f.suffix != ".gguf":
                (store / name / f.name).symlink_to(f)
    run(store / "a")
    assert len(cache_files(store / "a")) == 2
    next(a.glob("*.gguf")).unlink()
    run(store / "b")
    assert cache_files(store / "a") == [] and len(cache_files(store / "b")) == 2


def test_it_can_be_turned_off(tiny_models, tmp_path, counted, monkeypatch):
    from gguf_models import quantized_copy
    monkeypatch.setenv("SSD_PACK_CACHE", "0")
    folder = quantized_copy(tiny_models["llama"], tmp_path / "m", GGML.Q8_0)
    run(folder)
    assert cache_files(folder) == []


def test_the_kept_matrices_are_views_of_one_copy_of_the_file(tiny_models, tmp_path, counted):
    from gguf_models import quantized_copy
    from ssd.layers.linear import QuantLinear
    folder = quantized_copy(tiny_models["llama"], tmp_path / "m", GGML.Q8_0)
    run(folder)
    [bin_file] = [p for p in folder.iterdir() if p.suffix == ".bin"]
    with LLM(folder) as llm:
        storages = {m.parts[0].packed.untyped_storage() for m in llm.engine.runner.model.modules()
                    if isinstance(m, QuantLinear)}
    assert len({s.data_ptr() for s in storages}) == 1
    assert next(iter(storages)).nbytes() == bin_file.stat().st_size
