"""Every bad input gets one clear error: a ValueError subclass from the API, exit code 2
and no traceback from the CLI."""
import json
import subprocess
import sys

import pytest
import torch

from ssd import LLM, SamplingParams, SSDError
from ssd.bench.cli import build_spec
from ssd.cli import build_parser, main
from ssd.errors import (ContextLengthError, ModelFileError, ModelNotFoundError, PromptError, SamplingParamsError,
                        UnsupportedModelError)

SMOLLM = "smollm2-135m-instruct"


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.5}, "temperature must be >= 0 and finite"),
    ({"temperature": float("nan")}, "temperature must be >= 0 and finite"),
    ({"temperature": float("inf")}, "temperature must be >= 0 and finite"),
    ({"temperature": "hot"}, "temperature must be >= 0 and finite"),
    ({"top_p": 0.0}, "top_p must be in \\(0, 1\\]"),
    ({"top_p": 1.5}, "top_p must be in \\(0, 1\\]"),
    ({"top_p": float("nan")}, "top_p must be in \\(0, 1\\]"),
    ({"top_p": float("inf")}, "top_p must be in \\(0, 1\\]"),
    ({"top_k": -1}, "top_k must be an integer >= 0"),
    ({"top_k": 2.5}, "top_k must be an integer >= 0"),
    ({"top_k": True}, "top_k must be an integer >= 0"),
    ({"stop": [""]}, "stop strings must not be empty"),
    ({"stop": ["end", ""]}, "stop strings must not be empty"),
    ({"stop": ""}, "stop strings must not be empty"),
    ({"stop": 5}, "stop must be a string or a list of strings"),
    ({"stop": ["end", 5]}, "stop must be a string or a list of strings"),
    ({"stop_token_ids": ["2"]}, "stop_token_ids must be a list of token ids"),
    ({"seed": -1}, "seed must be None or an integer in 0..2\\*\\*64-1"),
    ({"seed": 2**64}, "seed must be None or an integer in 0..2\\*\\*64-1"),
    ({"seed": 1.5}, "seed must be None or an integer in 0..2\\*\\*64-1"),
    ({"seed": "7"}, "seed must be None or an integer in 0..2\\*\\*64-1"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"max_tokens": -5}, "max_tokens must be an integer >= 1"),
    ({"max_tokens": 2.5}, "max_tokens must be an integer >= 1"),
    ({"max_tokens": True}, "max_tokens must be an integer >= 1"),
])
def test_bad_sampling_values(kwargs, message):
    with pytest.raises(SamplingParamsError, match=message):
        SamplingParams(**kwargs)
    assert issubclass(SamplingParamsError, ValueError)


def test_edge_sampling_values_are_accepted():
    p = SamplingParams(temperature=0, top_p=1, top_k=0, seed=2**64 - 1, max_tokens=1, stop="end", stop_token_ids=7)
    assert p.stop == ["end"] and p.stop_token_ids == [7] and p.greedy_decoding


def test_empty_prompt(smollm):
    with pytest.raises(PromptError, match="empty"):
        smollm.generate("")
    with pytest.raises(PromptError, match="the chat is empty"):
        smollm.generate([[]])
    with pytest.raises(PromptError, match="the chat is empty"):
        next(smollm.stream([]))


@pytest.mark.parametrize("prompts, message", [
    (5, "prompts must be a string, a chat .* got int"),
    (None, "prompts must be a string, a chat .* got NoneType"),
    (b"hello", "prompts must be a string, a chat .* got bytes"),
    ({"role": "user", "content": "hi"}, "prompts must be a string, a chat .* got dict"),  # a message, not a chat
    ([1, "a"], "chat message 0 must be a dict"),  # neither token ids nor a chat
    ([[1, 10**9]], "token id 1000000000 is outside the vocabulary"),
    ([[1, 2], 5], "a prompt must be a string, a chat .* or token ids, got int"),
])
def test_generate_refuses_what_is_not_text_or_a_chat(smollm, prompts, message):
    with pytest.raises(PromptError, match=message):
        smollm.generate(prompts)


@pytest.mark.parametrize("prompt, message", [
    (5, "got int"), (None, "got NoneType"), (b"hello", "got bytes"), ([1, 2.5], "chat message 0 must be a dict"),
])
def test_stream_refuses_what_is_not_text_or_a_chat(smollm, prompt, message):
    with pytest.raises(PromptError, match=message):
        next(smollm.stream(prompt))


@pytest.mark.parametrize("chat, message", [
    ([{"content": "hi"}], "chat message 0 must be a dict with 'role' and 'content'"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant"}], "chat message 1 must be a dict"),
    ([{"role": "user", "content": "hi"}, "and more"], "chat message 1 must be a dict"),
    ([{"role": "user", "content": None}], "chat message 0 has content of type NoneType; content must be a string"),
    ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "content must be a string"),
    ([{"role": "tool", "content": "42"}], "chat template has no tool support"),  # SmolLM2's template
    ([{"role": "User", "content": "hi"}], "role 'User'; allowed roles: system, user, assistant, tool"),
])
def test_malformed_chat(smollm, chat, message):
    with pytest.raises(PromptError, match=message):
        smollm.generate(chat)
    with pytest.raises(PromptError, match=message):
        next(smollm.stream(chat))


def test_chat_for_a_model_without_a_chat_template(smollm_dir, tmp_path):
    for f in smollm_dir.iterdir():
        if f.name == "tokenizer_config.json":
            cfg = json.loads(f.read_text())
            cfg.pop("chat_template", None)
            (tmp_path / f.name).write_text(json.dumps(cfg))
        elif f.name != "chat_template.jinja":
            (tmp_path / f.name).symlink_to(f)
    with LLM(tmp_path) as llm:
        with pytest.raises(PromptError, match="has no chat template; pass a plain string"):
            llm.generate([{"role": "user", "content": "hi"}])
        assert llm.generate("hi", SamplingParams.greedy(max_tokens=2))[0].token_ids


def test_prompt_and_max_tokens_must_fit_the_context(smollm_dir):
    """Like OpenAI's context_length_exceeded: nothing is silently cut at the context end."""
    with LLM(smollm_dir, max_model_len=128) as llm:
        prompt = "word " * 99
        n = len(llm.encode(prompt))
        assert 90 < n < 128
        with pytest.raises(ContextLengthError) as e:
            llm.generate(prompt)  # the default max_tokens, 256
        assert str(e.value) == (f"This model's maximum context length is 128 tokens. However, you requested "
                                f"{n + 256} tokens ({n} in the prompt, 256 in the completion). Please reduce the "
                                f"length of the prompt or completion: max_tokens at most {128 - n}.")
        with pytest.raises(ContextLengthError, match=f"{129 - n} in the completion"):
            next(llm.stream(prompt, SamplingParams(max_tokens=129 - n)))
        with pytest.raises(ContextLengthError, match=r"\(1[3-9][0-9] in the prompt.*a shorter prompt"):
            llm.generate("word " * 140, SamplingParams(max_tokens=1))
        with pytest.raises(ContextLengthError):  # one request too long: none runs
            llm.generate(["Hello", prompt], SamplingParams.greedy(max_tokens=40))
        assert issubclass(ContextLengthError, PromptError)
        # The engine is still usable afterwards, and a request that fits exactly runs to the context end.
        out = llm.generate(prompt, SamplingParams.greedy(max_tokens=128 - n, ignore_eos=True))[0]
        assert out.finish_reason == "length" and n + len(out.token_ids) == 128


@pytest.mark.parametrize("model", ["no-such-model", "/no/such/folder", "/no/such/model.gguf"])
def test_unknown_model_lists_known_names(model):
    with pytest.raises(ModelNotFoundError, match=f"no model '{model}'.*known models: .*smollm2-135m-instruct"):
        LLM(model)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        LLM(tmp_path)


def test_folder_without_weights(tmp_path, smollm_dir):
    (tmp_path / "config.json").write_text((smollm_dir / "config.json").read_text())
    with pytest.raises(ModelFileError, match="no weights"):
        LLM(tmp_path)


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="warp"), "unknown mode 'warp'; available: ar, sd, ssd"),
    (dict(dtype="int3"), "unknown dtype 'int3'; choose one of float32"),
    (dict(speculate_kk=3), "unknown option speculate_kk; the speculation options are .*speculate_k"),
    (dict(mode="ssd"), "mode 'ssd' needs a draft model"),
    (dict(draft=SMOLLM, mode="sd", speculate_k=33), "speculate_k must be an integer in 1..32 or 'auto', got 33"),
    (dict(draft=SMOLLM, mode="ssd", speculate_k=2.5), "speculate_k must be an integer in 1..32 or 'auto', got 2.5"),
    (dict(draft=SMOLLM, mode="sd", speculate_k="fast"), "speculate_k must be an integer in 1..32 or 'auto', got 'fast'"),
    (dict(draft=SMOLLM, mode="sd", speculate_k="auto", k_max=0), "k_max must be an integer in 1..32, got 0"),
    (dict(draft=SMOLLM, mode="sd", speculate_k=4, k_max=6), "k_max applies to speculate_k='auto' only"),
    (dict(draft="ngram", mode="ssd"), "without a model\\) runs in mode 'sd', not 'ssd'"),
    (dict(threads=0), "threads must be .*>= 1, got 0"),
    (dict(block_size=0), "block_size must be an integer >= 1, got 0"),
    (dict(max_model_len=10**6), "max_model_len must be in 2..8192 for this model, got 1000000"),
    (dict(max_model_len=1), "max_model_len must be in 2..8192 for this model, got 1"),
])
def test_bad_engine_arguments(smollm_dir, kwargs, message):
    with pytest.raises(SSDError, match=message):
        LLM(smollm_dir, **kwargs)


def test_one_sampling_params_per_prompt(smollm):
    with pytest.raises(SSDError, match="2 prompts but 3 sampling params"):
        smollm.generate(["a", "b"], [SamplingParams(max_tokens=1)] * 3)
    with pytest.raises(SSDError, match="1 prompts but 2 sampling params"):
        smollm.generate("a", [SamplingParams(max_tokens=1)] * 2)
    with pytest.raises(SSDError, match="sampling params must be SamplingParams, got dict"):
        smollm.generate("a", {"max_tokens": 1})


def test_int8_draft_on_cuda_is_refused(smollm_dir, monkeypatch):
    """Refused before any weights load or CUDA is used, so a CPU-only machine checks it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SSDError, match="draft_quantization='int8' is for a draft on a CPU"):
        LLM(smollm_dir, draft=smollm_dir, mode="sd", device="cuda", draft_quantization="int8")


# ---- ssd bench --out ----------------------------------------------------------------
BENCH = ["bench", "--model", SMOLLM, "--draft", SMOLLM, "--no-progress", "--out"]


@pytest.mark.parametrize("earlier", ["results.json", "table.md", "tok_s.png", "speedup_vs_k.png"])
def test_bench_refuses_an_out_folder_with_earlier_results(tmp_path, capsys, earlier):
    (tmp_path / earlier).write_text("an earlier run")
    assert main(BENCH + [str(tmp_path)]) == 2  # returns before any model loads
    err = capsys.readouterr().err
    assert err == (f"ssd: error: --out {tmp_path} already holds an earlier run's results ({earlier}); "
                   "choose another folder, or pass --overwrite to replace them\n")


def test_bench_refuses_an_out_that_is_a_file(tmp_path, capsys):
    (tmp_path / "results").write_text("")
    assert main(BENCH + [str(tmp_path / "results")]) == 2
    assert "is a file; give a folder" in capsys.readouterr().err


def test_bench_overwrite_replaces_every_earlier_file(tmp_path, monkeypatch):
    """With --overwrite the earlier run's files go, so no old plot sits next to new results;
    other files stay. (The benchmark itself is replaced by stubs.)"""
    from ssd.bench import cli as bench_cli
    for name in ("results.json", "table.md", "speedup_vs_k.png", "notes.txt"):
        (tmp_path / name).write_text("old")
    monkeypatch.setattr(bench_cli, "load_prompts", lambda args: {})
    monkeypatch.setattr(bench_cli, "run_bench", lambda spec, prompts, progress: None)
    monkeypatch.setattr(bench_cli, "summarise", lambda result: [])
    monkeypatch.setattr(bench_cli, "format_table", lambda result, rows: "")

    def report(out, *_):
        (out / "results.json").write_text("new")
        return [out / "results.json"]
    monkeypatch.setattr(bench_cli, "write_report", report)
    monkeypatch.setattr(bench_cli, "write_plots", lambda out, result, rows: [])
    assert main(BENCH + [str(tmp_path), "--overwrite"]) == 0
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {"results.json": "new", "notes.txt": "old"}


def test_bench_accepts_a_new_or_unrelated_out_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    for out in (tmp_path, tmp_path / "new"):
        assert build_spec(build_parser().parse_args(BENCH + [str(out)])).model == SMOLLM


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ssd.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, word", [
    (["--model", "no-such-model", "--prompt", "hi"], "no-such-model"),
    (["--model", SMOLLM, "--prompt", ""], "empty"),
    (["--model", SMOLLM, "--prompt", "hi", "--temperature", "-1"], "temperature"),
    (["--model", SMOLLM, "--prompt", "hi", "--temperature", "nan"], "temperature must be >= 0 and finite"),
    (["--model", SMOLLM, "--prompt", "hi", "--stop", ""], "stop strings must not be empty"),
    (["--model", SMOLLM, "--prompt", "hi", "--top-p", "2"], "top_p"),
    (["--model", SMOLLM, "--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
    (["--model", SMOLLM, "--prompt", "hi", "--max-model-len", "64", "--max-tokens", "100"],
     "maximum context length is 64 tokens"),
])
def test_cli_bad_input_exits_2_without_traceback(args, word):
    r = run_cli("generate", *args)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("ssd: error: ") and r.stderr.count("\n") == 1 and word in r.stderr
    assert r.stdout == ""


def test_a_typo_in_a_model_name_is_answered_with_the_near_name():
    with pytest.raises(ModelNotFoundError, match="did you mean 'smollm2-135m-instruct'"):
        LLM("smollm2-135m-instuct")


@pytest.mark.parametrize("device,message", [("mps", "device='cpu'"), ("xpu", "the CPU and on CUDA GPUs"),
                                            ("gpu", "device 'gpu'")])
def test_a_device_other_than_the_cpu_or_cuda_is_refused_by_name(smollm_dir, device, message):
    """Apple's GPU among them: no silent fallback to ops that are not batch-invariant."""
    with pytest.raises(SSDError, match=message):
        LLM(smollm_dir, device=device)
