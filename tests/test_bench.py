"""`ssd bench` end to end on SmolLM2-135M as its own draft: 2 prompts, a few tokens."""
import json
import subprocess
import sys

import pytest

from ssd.bench.plots import write_plots
from ssd.bench.prompts import BenchPrompt
from ssd.bench.report import COLUMNS, format_table, summarise, write_report
from ssd.bench.runner import BenchSpec, RunConfig, expand_configs, run_bench
from ssd.cli import main

SMOLLM = "smollm2-135m-instruct"
PROMPTS = {"mini": [BenchPrompt("file", "q/0", "What is the capital of France?"),
                    BenchPrompt("file", "q/1", "Write a haiku about the sea.")]}
N = 8
LABELS = ["ar", "sd k=1", "sd k=2", "ssd k=1", "ssd k=2", "hf", "hf-assisted k=2", "llamacpp", "llamacpp-spec k=2"]
METRICS = {"prompt_tokens", "output_tokens", "ttft_s", "decode_s", "e2e_s", "tokens_per_second"}


@pytest.fixture(scope="module")
def bench(smollm_dir, tmp_path_factory):
    configs = expand_configs(["ar", "sd", "ssd"], 2, sweep=("k", [1, 2]), peers=["hf", "llamacpp"])
    # The draft on the target's own blocks (not the default Q4_0 copy): every proposal is the target's.
    spec = BenchSpec(str(smollm_dir), str(smollm_dir), configs, max_tokens=N, ignore_eos=True, threads=2, sweep="k",
                     draft_quantization="gguf")
    result = run_bench(spec, PROMPTS, progress=False)
    rows = summarise(result)
    out = tmp_path_factory.mktemp("bench")
    files = write_report(out, result, rows) + write_plots(out, result, rows)
    return result, rows, out, files


def labels(*args, **kwargs) -> list[str]:
    return [c.label for c in expand_configs(*args, **kwargs)]


def test_expand_configs():
    assert labels(["ar", "sd", "ssd"], 4) == ["ar", "sd k=4", "ssd k=4"]
    assert labels(["ar", "sd", "ssd"], 4, fan_out=(3, 1), backup="jit", sweep=("f", [1, "auto"])) == [
        "ar", "sd k=4", "ssd k=4 f=1 backup=jit", "ssd k=4 f=auto backup=jit"]
    assert labels(["sd"], 3, peers=["llamacpp"]) == ["sd k=3", "llamacpp", "llamacpp-spec k=3"]
    assert RunConfig("ssd", 4, (("fan_out", (4, 2, 1)),)).label == "ssd k=4 f=4,2,1"
    assert labels(["ar", "sd", "ngram"], "auto", sweep=("lookup", [True, False])) == [
        "ar", "sd k=auto lookup=on", "sd k=auto lookup=off", "ngram k=auto"]
    assert BenchSpec("m", "d", []).engine_kwargs(RunConfig("sd", "auto", (("prompt_lookup", False),)))["prompt_lookup"] is False
    assert labels(["ar", "sd", "ngram"], "auto", sweep=("siblings", [False, True])) == [
        "ar", "sd k=auto siblings=off", "sd k=auto siblings=on", "ngram k=auto"]
    assert BenchSpec("m", "d", []).engine_kwargs(RunConfig("sd", "auto", (("draft_siblings", True),)))["draft_siblings"] is True
    assert labels(["ar", "sd", "ssd", "ngram"], 3, sweep=("guesses", [False, True])) == [
        "ar", "sd k=3 guesses=off", "sd k=3 guesses=on", "ssd k=3 guesses=off", "ssd k=3 guesses=on", "ngram k=3"]
    assert BenchSpec("m", "d", []).engine_kwargs(RunConfig("sd", 3, (("draft_guesses", False),)))["draft_guesses"] is False
    assert labels(["ar", "sd", "ssd"], "auto", sweep=("stop", [False, True])) == [
        "ar", "sd k=auto stop=off", "sd k=auto stop=on", "ssd k=auto"]
    assert BenchSpec("m", "d", []).engine_kwargs(RunConfig("sd", "auto", (("draft_stop", False),)))["draft_stop"] is False
    assert labels(["ar", "sd", "ngram"], "auto", sweep=("kmax", [8, 16])) == [
        "ar", "sd k=auto kmax=8", "sd k=auto kmax=16", "ngram k=auto kmax=8", "ngram k=auto kmax=16"]
    assert BenchSpec("m", "d", []).engine_kwargs(RunConfig("ngram", "auto", (("k_max", 16),)))["k_max"] == 16
    assert labels(["ar", "sd", "ngram"], "auto", sweep=("w", [None, 64])) == [
        "ar", "sd k=auto w=all", "sd k=auto w=64", "ngram k=auto"]
    spec = BenchSpec("m", "d", [])
    assert spec.engine_kwargs(RunConfig("sd", "auto", (("draft_window", None),)))["draft_window"] is None
    assert spec.engine_kwargs(RunConfig("sd", "auto", (("draft_window", 64),)))["draft_window"] == 64


def test_sweep_gives_one_row_per_value_and_greedy_modes_match_ar(bench):
    result, rows, _, _ = bench
    assert [r.config for r in rows] == LABELS and {r.set for r in rows} == {"mini"}
    by = {r.config: r for r in rows}
    assert by["ar"].same_as_ar == "ref" and by["ar"].speedup == pytest.approx(1.0)
    for label in ("sd k=1", "sd k=2"):
        r = by[label]
        assert r.same_as_ar == "yes" and r.acceptance == 1.0  # the model as its own draft
        assert 1 < r.accepted_len <= 3 and r.speedup > 0 and r.tok_s > 0 and r.prompts == 2
    for label in ("ssd k=1", "ssd k=2"):  # the runner skips a configuration whose LLM(...) fails: not these
        r = by[label]
        assert r.skipped is None and r.same_as_ar == "yes" and r.prompts == 2, r
        assert r.hit_rate is not None and 1 < r.accepted_len <= 3
    assert not {label for label in result.skipped if label.split()[0] in ("ar", "sd", "ssd")}, result.skipped
    assert by["hf"].skipped is None and by["hf"].same_as_ar != "n.a." and by["hf"].acceptance is None
    assert by["llamacpp"].skipped or by["llamacpp"].tok_s > 0  # no GGUF for a folder: skipped with a reason
    assert by["sd k=1"].hit_rate is None


def test_results_json(bench):
    result, rows, out, _ = bench
    data = json.loads((out / "results.json").read_text())
    assert {"schema", "created", "machine", "config", "prompt_sets", "summary", "skipped", "records"} <= set(data)
    assert {"cpu", "cores", "ram_gib", "versions", "git_commit"} <= set(data["machine"])
    assert {"torch", "transformers", "ssd-engine"} <= set(data["machine"]["versions"])
    config = data["config"]
    assert config["max_tokens"] == N and config["temperature"] == 0 and config["sweep"] == "k"
    assert config["draft_weights_resolved"] == "gguf"
    assert [c["label"] for c in config["configs"]] == LABELS and config["configs"][2]["k"] == 2
    assert data["prompt_sets"]["mini"]["prompt_ids"] == ["q/0", "q/1"]
    assert len(data["summary"]) == len(LABELS) and data["skipped"] == result.skipped
    ran = [label for label in LABELS if label not in result.skipped]
    assert sorted({r["config"] for r in data["records"]}) == sorted(ran)
    assert len(data["records"]) == 2 * len(ran)
    for r in data["records"]:
        assert {"set", "prompt_id", "config", "batch", "batch_wall_s", "token_ids", "same_as_ar"} <= set(r)
        assert METRICS <= set(r["metrics"]) and len(r["token_ids"]) == r["metrics"]["output_tokens"] == N
    sd = next(r for r in data["records"] if r["config"] == "sd k=2")
    assert sd["metrics"]["drafted_by_position"] and sd["same_as_ar"] is True


def test_table(bench):
    result, rows, out, _ = bench
    text = format_table(result, rows)
    header, rule = text.splitlines()[:2]
    assert header.split() == " ".join(COLUMNS).split() and set(rule) == {"-", " "}
    for label in LABELS:
        assert any(line.startswith("mini ") and f"  {label}  " in line for line in text.splitlines())
    assert "100%" in text and "yes" in text and "ref" in text
    assert result.draft_weights == "gguf" and "(weights: gguf)" in text  # as resolved and run
    for label, reason in result.skipped.items():
        assert f"skipped {label}: {reason}" in text
    md = (out / "table.md").read_text()
    assert md.startswith("| set | config |") and "| mini | sd k=2 | 2 |" in md


def test_plots_written(bench):
    _, _, out, files = bench
    names = {p.name for p in files}
    assert names == {"results.json", "table.md", "tok_s.png", "acceptance_by_position.png", "speedup_vs_k.png"}
    for name in names - {"results.json", "table.md"}:
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000


BASE = ["bench", "--model", SMOLLM, "--draft", SMOLLM, "--no-progress"]


@pytest.mark.parametrize("args, message", [
    (["nosuchset"], "unknown prompt set 'nosuchset'; known sets: humaneval, gsm8k, mtbench, aclsum"),
    (["--modes", "ar,fast"], "unknown mode 'fast'; choose from ar, sd, ssd"),
    (["--modes", ","], "--modes is empty"),
    (["--peers", "vllm"], "unknown peer 'vllm'; choose from hf, llamacpp"),
    (["--sweep", "k=2,x"], "--sweep k: bad K 'x'"),
    (["--sweep", "n=1,2"], "bad --sweep 'n=1,2'"),
    (["--sweep", "k=2,2"], "repeats a value"),
    (["--modes", "sd", "--sweep", "k=2,4"], "add ar to --modes"),
    (["--modes", "ar,sd", "--sweep", "f=1,2"], "needs one of the modes ssd"),
    (["--modes", "ar,ngram", "--sweep", "v=full,100"], "needs one of the modes sd, ssd"),
    (["--modes", "ar,ngram", "--sweep", "lookup=on,off"], "needs one of the modes sd"),
    (["--modes", "ar,sd", "--sweep", "lookup=on,maybe"], "expected on or off"),
    (["--modes", "ar,ssd", "--sweep", "siblings=on,off"], "needs one of the modes sd"),
    (["--modes", "ar,ngram", "--sweep", "guesses=on,off"], "needs one of the modes sd, ssd"),
    (["--modes", "ar,ngram", "--sweep", "w=all,64"], "needs one of the modes sd, ssd"),
    (["--modes", "ar,ssd", "--sweep", "stop=on,off"], "needs one of the modes sd"),
    (["--modes", "ar,ssd", "--sweep", "kmax=8,16"], "needs one of the modes ngram, sd"),
    (["--modes", "ar,sd", "--sweep", "kmax=8,0"], "--sweep kmax: k_max must be"),
    (["--modes", "ar,sd", "--sweep", "w=all,0"], "--sweep w: draft_window must be"),
    (["--k", "often"], "bad K 'often'"),
    (["--modes", "ar,sd", "--f", "2"], "apply to mode ssd"),
    (["--f", "2,0"], "--f: expected a whole number >= 1, got '0'"),
    (["--batch-size", "0"], "must be at least 1"),
    (["--busy-cores", "-1"], "--busy-cores must be 0 or more"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--num-prompts", "0"], "--num-prompts must be at least 1"),
    (["--prompts", "/no/such/file.jsonl"], "cannot read prompts file"),
    (["--draft", "no-such-model"], "no model 'no-such-model'"),
])
def test_bad_input_is_one_line(capsys, args, message):
    assert main(BASE + args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ssd: error: ") and message in err and "\n" not in err


def test_draft_needed_for_other_targets(capsys):
    assert main(["bench", "--model", SMOLLM, "--modes", "ar,sd"]) == 2
    assert "--draft is needed" in capsys.readouterr().err


def test_cli_end_to_end_batched_and_sampled(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Name a color."}\n{"prompt": "Count to five.", "id": "count"}\n')
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "ssd.cli", *BASE, "--prompts", str(prompts), "--modes", "ar,sd",
                        "--max-tokens", "6", "--batch-size", "2", "--temperature", "0.8", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:3] == ["set", "config", "n"]
    assert lines[2].startswith("p.jsonl  ar ") and lines[3].split()[-2:] == ["n.a.", "-"]  # sampled: no identity check
    assert "=AR is n.a. at temperature > 0" in r.stdout
    data = json.loads((out / "results.json").read_text())
    assert data["cli_args"]["batch_size"] == 2 and data["config"]["batch_size"] == 2
    records = [r for r in data["records"] if r["config"] == "sd k=4"]
    assert [r["prompt_id"] for r in records] == ["file/0", "count"]
    assert [r["batch"] for r in records] == [0, 0] and records[0]["batch_wall_s"] == records[1]["batch_wall_s"]
    assert (out / "tok_s.png").exists() and (out / "table.md").exists()


def test_seeded_sampled_runs_are_checked_against_ar(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Name a color."}\n{"prompt": "Count to five."}\n')
    r = subprocess.run([sys.executable, "-m", "ssd.cli", *BASE, "--prompts", str(prompts), "--modes", "ar,sd,ngram",
                        "--max-tokens", "12", "--temperature", "0.8", "--seed", "7"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.startswith("p.jsonl")]
    assert [row[-2] for row in rows] == ["ref", "yes", "yes"], r.stdout
    assert "every request carries seed 7" in r.stdout


def test_structured_prompts_are_checked(smollm_dir):
    schema = {"type": "object", "required": ["city", "country"], "additionalProperties": False,
              "properties": {"city": {"type": "string"}, "country": {"type": "string"}}}
    prompts = {"json": [BenchPrompt("file", "j/0", "Name a capital city and its country as JSON.", schema=schema),
                        BenchPrompt("file", "j/1", "Give a city in Japan as JSON.", schema=schema)]}
    configs = expand_configs(["ar", "ngram"], 2, peers=["llamacpp"])
    spec = BenchSpec(str(smollm_dir), None, configs, max_tokens=40, threads=2)
    result = run_bench(spec, prompts, progress=False)
    rows = {r.config: r for r in summarise(result)}
    assert rows["ar"].valid == "2/2" and rows["ngram k=2"].valid == "2/2" and rows["ngram k=2"].same_as_ar == "yes"
    assert "llamacpp" in result.skipped and "JSON schema" in result.skipped["llamacpp"]


def test_a_peer_skips_only_the_sets_with_a_schema(smollm_dir):
    schema = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}
    prompts = {"json": [BenchPrompt("file", "j/0", "Name a capital city as JSON.", schema=schema)],
               "plain": [BenchPrompt("file", "p/0", "Name a capital city.")]}
    configs = [c for c in expand_configs(["ar"], 2, peers=["hf"]) if c.mode in ("ar", "hf")]
    spec = BenchSpec(str(smollm_dir), None, configs, max_tokens=8, threads=2)
    result = run_bench(spec, prompts, progress=False)
    rows = {(r.set, r.config): r for r in summarise(result)}
    assert "JSON schema" in rows["json", "hf"].skipped and set(result.skipped) == {"hf on json"}
    assert rows["plain", "hf"].skipped is None and rows["plain", "hf"].tok_s > 0
    assert "skipped hf on json: prompts with a JSON schema" in format_table(result, summarise(result))


def test_help_lists_every_option():
    r = subprocess.run([sys.executable, "-m", "ssd.cli", "bench", "--help"], capture_output=True, text=True)
    assert r.returncode == 0
    for flag in ("--model", "--draft", "--all", "--prompts", "--num-prompts", "--chat-template", "--modes", "--k",
                 "--f", "--backup", "--sweep", "--temperature", "--batch-size", "--max-tokens", "--ignore-eos",
                 "--peers", "--out", "humaneval, gsm8k, mtbench, aclsum"):
        assert flag in r.stdout


def test_a_lookup_sweep_is_plotted(tmp_path):
    """--sweep lookup=on,off: the sweep's plot names its values on and off."""
    from ssd.bench.prompts import BenchPrompt
    from ssd.bench.runner import BenchResult, PromptRecord
    configs = expand_configs(["ar", "sd"], "auto", sweep=("lookup", [True, False]))
    spec = BenchSpec("m", "d", configs, sweep="lookup")
    metrics = dict(output_tokens=9, decode_s=1.0, tokens_per_second=8.0, ttft_s=0.1, rounds=4, drafted=8,
                   accepted=4, k_hist=[0, 0, 4], lookup_rounds=1, accepted_by_position=[3, 1],
                   drafted_by_position=[4, 4])
    records = [PromptRecord("s", "p", c.label, 0, 1.0, [1] * 9, metrics) for c in configs]
    result = BenchResult(spec, {"s": [BenchPrompt("s", "p", "text")]}, records, threads=2)
    rows = summarise(result)
    assert [r.lookup_share for r in rows] == [0.25, 0.25, 0.25]
    names = {p.name for p in write_plots(tmp_path, result, rows)}
    assert "speedup_vs_lookup.png" in names


def test_busy_cores_spin_beside_each_configuration_and_stop_after(smollm_dir, monkeypatch):
    """--busy-cores: the loops run while a configuration generates (and a peer runs), none is
    left after; the tokens are those of a quiet run (AR and SD agree)."""
    import psutil

    import ssd.bench.runner as runner
    seen = []
    real = runner.LLM.generate

    def loops() -> list:
        return [c for c in psutil.Process().children() if "while True" in " ".join(c.cmdline())]

    def generate(self, *args, **kwargs):
        seen.append(len(loops()))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(runner.LLM, "generate", generate)
    spec = BenchSpec(str(smollm_dir), "ngram", expand_configs(["ar", "ngram"], 2), max_tokens=8, threads=2,
                     busy_cores=1)
    result = run_bench(spec, PROMPTS, progress=False)
    assert seen and seen[:2] == [0, 0] and all(n == 1 for n in seen[2:])  # the warm-ups quiet, the turns busy
    assert not loops()
    assert all(r.same_as_ar for r in result.records if r.config != "ar")
