import json
import subprocess
import sys
from pathlib import Path

import pytest


def ssd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ssd.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_json_prints_exactly_one_object():
    r = ssd("generate", "--model", "smollm2-135m-instruct", "--prompt", "What is the capital of France?",
            "--chat", "--temperature", "0", "--max-tokens", "16", "--json", "--weights", "dequantized")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)  # fails if anything else is on stdout
    assert set(out) == {"text", "token_ids", "finish_reason", "metrics"}
    assert "Paris" in out["text"] and out["finish_reason"] in ("stop", "length")
    assert {"prompt_tokens", "output_tokens", "ttft_s", "tokens_per_second"} <= set(out["metrics"])
    assert out["metrics"]["output_tokens"] == len(out["token_ids"])


def test_generate_under_a_json_schema_file(tmp_path):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    (tmp_path / "answer.json").write_text(json.dumps(schema))
    r = ssd("generate", "--model", "smollm2-135m-instruct", "--prompt", "What is 6 times 7? Answer in JSON.",
            "--chat", "--temperature", "0", "--max-tokens", "24", "--json", "--json-schema",
            str(tmp_path / "answer.json"), "--logprobs", "1", "--presence-penalty", "0.5")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert isinstance(json.loads(out["text"])["answer"], int) and out["finish_reason"] == "stop"
    assert len(out["logprobs"]) == len(out["token_ids"]) and len(out["logprobs"][0]["top"]) == 1
    r = ssd("generate", "--model", "smollm2-135m-instruct", "--prompt", "x", "--json-schema", str(tmp_path / "no"))
    assert r.returncode == 2 and "--json-schema: cannot read" in r.stderr and "Traceback" not in r.stderr


def test_generate_streams_text_then_metrics_line():
    r = ssd("generate", "--model", "smollm2-135m-instruct", "--prompt", "Once upon a time",
            "--temperature", "0", "--max-tokens", "8", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and "tok/s" in r.stderr and "8 tokens" in r.stderr


@pytest.mark.parametrize("cmd", [[], ["generate"], ["pull"], ["models"]])
def test_help_is_complete(cmd):
    r = ssd(*cmd, "--help")
    assert r.returncode == 0 and "usage: ssd" in r.stdout
    if cmd == ["generate"]:
        for flag in ("--model", "--prompt", "--chat", "--max-tokens", "--temperature", "--top-k",
                     "--top-p", "--seed", "--json", "--threads"):
            assert flag in r.stdout


def test_models_lists_known_models():
    r = ssd("models", "--json")
    names = {m["name"]: m for m in json.loads(r.stdout)}
    assert {"qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"} <= set(names)
    assert names["smollm2-135m-instruct"]["present"]


def test_the_options_reference_in_docs_is_made_from_the_declarations():
    from ssd.speculative.options import reference
    path = Path(__file__).parent.parent / "docs" / "options.md"
    assert path.read_text() == reference(), ("docs/options.md is stale: write it again with\n  python -c \"from "
                                             "ssd.speculative.options import reference; print(reference(), end='')\" "
                                             "> docs/options.md")


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["generate", "--help"], ["models"]])
def test_help_and_the_model_list_load_no_torch(argv):
    """`ssd --help`, a command's help and `ssd models` answer without importing torch (its
    import alone takes about a second: bench/studies/cli_start.py measures the commands)."""
    code = ("import sys\nfrom ssd.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
