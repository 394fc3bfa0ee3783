"""Every bad input gets one clear error: a ValueError subclass from the API, exit code 2
and no traceback from the CLI."""
import json
import subprocess
import sys

import pytest

from ssd import LLM, SamplingParams, SSDError
from ssd.errors import (ModelFileError, ModelNotFoundError, PromptError, SamplingParamsError,
                        UnsupportedModelError)


@pytest.mark.parametrize("kwargs, word", [
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_bad_sampling_values(kwargs, word):
    with pytest.raises(SamplingParamsError, match=word):
        SamplingParams(**kwargs)
    assert issubclass(SamplingParamsError, ValueError)


def test_empty_prompt(smollm):
    with pytest.raises(PromptError, match="empty"):
        smollm.generate("")
    with pytest.raises(PromptError):
        smollm.generate([[]])


def test_prompt_longer_than_context(smollm_dir):
    with LLM(smollm_dir, max_model_len=32) as llm:
        with pytest.raises(PromptError, match="context"):
            llm.generate("word " * 40)
        # The engine is still usable afterwards, and output stops at the context end.
        out = llm.generate("Hello", SamplingParams.greedy(max_tokens=100, ignore_eos=True))[0]
        assert out.finish_reason == "length" and out.metrics.prompt_tokens + len(out.token_ids) == 32


def test_unknown_model_lists_known_names():
    with pytest.raises(ModelNotFoundError, match="smollm2-135m-instruct"):
        LLM("no-such-model")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        LLM(tmp_path)


def test_folder_without_weights(tmp_path, smollm_dir):
    (tmp_path / "config.json").write_text((smollm_dir / "config.json").read_text())
    with pytest.raises(ModelFileError, match="safetensors"):
        LLM(tmp_path)


def test_bad_engine_arguments(smollm_dir):
    with pytest.raises(SSDError, match="mode"):
        LLM(smollm_dir, mode="warp")
    with pytest.raises(SSDError, match="dtype"):
        LLM(smollm_dir, dtype="int3")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ssd.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, word", [
    (["--model", "no-such-model", "--prompt", "hi"], "no-such-model"),
    (["--model", "smollm2-135m-instruct", "--prompt", ""], "empty"),
    (["--model", "smollm2-135m-instruct", "--prompt", "hi", "--temperature", "-1"], "temperature"),
    (["--model", "smollm2-135m-instruct", "--prompt", "hi", "--top-p", "2"], "top_p"),
    (["--model", "smollm2-135m-instruct", "--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
])
def test_cli_bad_input_exits_2_without_traceback(args, word):
    r = run_cli("generate", *args)
    assert r.returncode == 2, r.stderr
    assert word in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == ""
