import json

import pytest

from ssd.bench.prompts import PROMPT_SETS, BenchPrompt, load_prompt_set, load_prompts_file
from ssd.errors import SSDError

FIRST_IDS = {
    "humaneval": ["HumanEval/0", "HumanEval/1", "HumanEval/2"],
    "gsm8k": ["gsm8k/0", "gsm8k/1", "gsm8k/2"],
    "mtbench": ["mtbench/81", "mtbench/91", "mtbench/101"],
    "aclsum": ["aclsum/E09-1056", "aclsum/N19-1362", "aclsum/P01-1040"],
    "json-math": ["json-math/0", "json-math/1", "json-math/2"],
    "json-code": ["json-code/0", "json-code/1", "json-code/2"],
}


@pytest.mark.parametrize("name", list(PROMPT_SETS))
def test_prompt_set_fixed_selection(name):
    prompts = load_prompt_set(name, num_prompts=3)
    assert [p.id for p in prompts] == FIRST_IDS[name]
    assert all(p.set == name and p.text.strip() for p in prompts)
    assert load_prompt_set(name, num_prompts=3) == prompts
    assert load_prompt_set(name)[:3] == prompts


def test_set_sizes_and_texts():
    assert [len(load_prompt_set(n)) for n in PROMPT_SETS] == [164, 1319, 80, 100, 1319, 164]
    assert load_prompt_set("humaneval", 1)[0].text.startswith("from typing import List\n")
    assert load_prompt_set("gsm8k", 1)[0].text.startswith("Janet’s ducks lay 16 eggs per day.")
    assert load_prompt_set("mtbench", 1)[0].text.startswith("Compose an engaging travel blog post")
    long = load_prompt_set("aclsum", 1)[0].text
    assert long.startswith("Summarize the following paper introduction in a few sentences:\n\nIf machine")
    assert len(long) > 1000
    math, code = load_prompt_set("json-math", 1)[0], load_prompt_set("json-code", 1)[0]
    assert "Janet’s ducks" in math.text and len(math.schema["required"]) == 6
    assert "from typing import List" in code.text and len(code.schema["required"]) == 7


def test_mtbench_spreads_over_categories():
    prompts = load_prompt_set("mtbench", num_prompts=16)
    categories = [p.category for p in prompts]
    assert categories[:8] == ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                              "humanities"]
    assert categories[8:] == categories[:8]
    assert [p.id for p in prompts[8:10]] == ["mtbench/82", "mtbench/92"]


def test_unknown_set_and_bad_count():
    with pytest.raises(SSDError, match="known sets: humaneval, gsm8k, mtbench, aclsum"):
        load_prompt_set("alpaca")
    with pytest.raises(SSDError, match="at least 1"):
        load_prompt_set("gsm8k", 0)


def test_prompts_file(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [{"prompt": "a"}, {"text": "b", "id": "mine", "category": "c"},
             {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "m"}]},
             {"turns": ["t1", "t2"]}]
    path.write_text("\n".join(map(json.dumps, lines[:2])) + "\n\n" + "\n".join(map(json.dumps, lines[2:])) + "\n")
    assert load_prompts_file(path) == [
        BenchPrompt("file", "file/0", "a"), BenchPrompt("file", "mine", "b", "c"),
        BenchPrompt("file", "file/2", "m"), BenchPrompt("file", "file/3", "t1")]
    path.write_text(json.dumps({"prompt": "a", "schema": {"type": "object"}}) + "\n")
    assert load_prompts_file(path)[0].schema == {"type": "object"}
    path.write_text(json.dumps({"prompt": "a", "schema": "object"}) + "\n")
    with pytest.raises(SSDError, match="schema"):
        load_prompts_file(path)


@pytest.mark.parametrize("content, match", [
    (None, "cannot read"),
    ("", "no prompts"),
    ('{"prompt": "a"}\n{"prompt": "b"\n', "line 2: not valid JSON"),
    ('{"prompt": "a"}\n{"question": "b"}\n', 'line 2: expected an object with a non-empty "prompt"'),
    ('{"prompt": "  "}\n', "line 1: expected"),
    ('["a"]\n', "line 1: expected"),
    ('{"prompt": "a", "id": "x"}\n{"prompt": "b", "id": "x"}\n', "line 2: duplicate id 'x'"),
])
def test_bad_prompts_file(tmp_path, content, match):
    path = tmp_path / "p.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SSDError, match=match):
        load_prompts_file(path)
