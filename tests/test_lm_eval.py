"""lm-evaluation-harness scores a multiple-choice task through `ssd serve` (its
`local-completions` backend: echo, logprobs, token ids) and picks what its `hf` backend picks
on the same weights. Slow (lm_eval is not among the test extras; a minute on 2 CPU cores):

    pip install "lm_eval[api]"; python -m pytest -m slow tests/test_lm_eval.py -s
"""
import json

import pytest

from serving import start_server

pytestmark = pytest.mark.slow
QUESTIONS = [
    ("What color is the sky on a clear day?", ["blue", "green", "red", "black"], 0),
    ("How many legs does a dog have?", ["two", "four", "six", "eight"], 1),
    ("What is the capital of France?", ["Berlin", "Madrid", "Paris", "Rome"], 2),
    ("Which animal says meow?", ["cow", "dog", "duck", "cat"], 3),
    ("What do bees make?", ["honey", "milk", "silk", "wool"], 0),
    ("What is frozen water called?", ["steam", "ice", "sand", "glass"], 1),
    ("Which planet do we live on?", ["Mars", "Venus", "Earth", "Jupiter"], 2),
    ("What is two plus two?", ["three", "five", "six", "four"], 3),
    ("Which season is the coldest?", ["winter", "summer", "spring", "autumn"], 0),
    ("What do you use to write on paper?", ["a spoon", "a pencil", "a shoe", "a cup"], 1),
]


def _task(folder) -> None:
    with open(folder / "mc.jsonl", "w") as f:
        for q, choices, answer in QUESTIONS:
            f.write(json.dumps({"question": q, "choices": choices, "answer": answer}) + "\n")
    (folder / "ssd_mc.yaml").write_text(f"""task: ssd_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")


def _scores(result) -> list[list[float]]:
    """Each question's loglikelihood of each choice, in the task's order."""
    samples = sorted(result["samples"]["ssd_mc"], key=lambda s: s["doc_id"])
    return [[float(r[0]) for r in s["filtered_resps"]] for s in samples]


def test_local_completions_picks_what_hf_picks(smollm_dir, tmp_path):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    _task(tmp_path)
    tasks = TaskManager(include_path=str(tmp_path))
    server = start_server("--model", str(smollm_dir), "--served-model-name", "m", tmp_path=tmp_path)
    try:
        served = lm_eval.simple_evaluate(
            model="local-completions", tasks=["ssd_mc"], task_manager=tasks, log_samples=True,
            model_args=f"model=m,base_url={server.base_url}/completions,tokenizer={smollm_dir},"
                       "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1")
    finally:
        server.stop()
    hf = lm_eval.simple_evaluate(model="hf", tasks=["ssd_mc"], task_manager=tasks, log_samples=True, device="cpu",
                                 model_args=f"pretrained={smollm_dir},gguf_file=model.gguf,tokenizer={smollm_dir},"
                                            "dtype=float32")
    ours, theirs = _scores(served), _scores(hf)
    picks = lambda scores: [max(range(len(s)), key=s.__getitem__) for s in scores]  # noqa: E731
    gap = max(abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x, y))
    acc = [r["results"]["ssd_mc"]["acc,none"] for r in (served, hf)]
    print(f"accuracy: served {acc[0]:.2f}, hf {acc[1]:.2f}; largest loglikelihood difference {gap:.3f} nats")
    assert picks(ours) == picks(theirs)
    # The engine's 8-bit activations against transformers' fp32 on the dequantised Q4_1 weights,
    # summed over a choice's tokens: 0.77 nats at most here, the picks all alike.
    assert gap < 1.5
