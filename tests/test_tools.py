"""Tool calling: tools rendered by the model's template, calls parsed, `required` and a named
function enforced by a grammar (arguments that always parse and validate), in every mode."""
import json

import jsonschema
import pytest

from ssd import LLM, SamplingParams
from ssd.errors import PromptError
from ssd.tools import CallStream, ToolError, ToolFormat, Tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "required": ["a", "b"], "additionalProperties": False,
                   "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def llm(tool_model):
    with LLM(tool_model) as llm:
        yield llm


def valid(calls) -> bool:
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
    return bool(calls)


@pytest.mark.parametrize("tools, choice, parallel, says", [
    ([], "auto", True, "non-empty list"),
    ([{"type": "function", "function": {"parameters": {}}}], "auto", True, "name must be"),
    ([{"type": "function", "function": {"name": "has space"}}], "auto", True, "name must be"),
    ([WEATHER, WEATHER], "auto", True, "used twice"),
    ([{"type": "retrieval"}], "auto", True, "must be {'type': 'function'"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "auto", True, "JSON schema object"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, True, "not among the tools"),
    (TOOLS, "sometimes", True, "tool_choice must be"),
    (TOOLS, "auto", "yes", "parallel_tool_calls must be a boolean"),
])
def test_bad_tools_are_refused(tools, choice, parallel, says):
    with pytest.raises(ToolError) as e:
        Tools.check(tools, choice, parallel)
    assert says in str(e.value)


def test_calls_are_parsed_from_the_models_format():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n' \
           '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>'
    content, calls = ToolFormat.parse(text, ("<|im_end|>",))
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[1].arguments) == {"a": 1, "b": 2} and calls[0].id != calls[1].id
    assert ToolFormat.parse("<tool_call>\n{not json}\n</tool_call>") == ("<tool_call>\n{not json}\n</tool_call>", [])
    cut = text.split("<tool_call>\n{\"name\": \"add\"")[0] + '<tool_call>\n{"name": "ad'
    assert [c.name for c in ToolFormat.parse(cut)[1]] == ["get_weather"]  # a last call cut short is dropped
    bare = '```json\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n```'
    assert ToolFormat.parse(bare, names=("add",))[1][0].arguments == '{"a": 1, "b": 2}'
    assert ToolFormat.parse(bare, names=("sub",)) == (bare, [])  # only a function of the request
    assert ToolFormat.parse('{"name": "add", "arguments": 3}', names=("add",))[1] == []


def test_several_json_calls_in_one_answer_are_calls():
    """Qwen2.5-Coder writes two calls as two objects in one ```json fence, or as a list."""
    one, two = '{"name": "add", "arguments": {"a": 1, "b": 2}}', '{"name": "sub", "arguments": {"a": 5, "b": 3}}'
    names = ("add", "sub")
    for text in (f"```json\n{one}\n{two}\n```", f"```json\n{one}\n\n{two}\n```", f"{one}\n{two}",
                 f"[{one}, {two}]", f"```json\n[\n  {one},\n  {two}\n]\n```", f"```\n{one}{two}\n```"):
        content, calls = ToolFormat.parse(text, names=names)
        assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == \
            [("add", {"a": 1, "b": 2}), ("sub", {"a": 5, "b": 3})], text
        assert calls[0].id != calls[1].id
    assert [c.name for c in ToolFormat.parse(f"[{one}, {two}]", names=names, parallel=False)[1]] == ["add"]
    blocks = f"<tool_call>\n{one}\n</tool_call>\n<tool_call>\n{two}\n</tool_call>"
    assert [c.name for c in ToolFormat.parse(blocks, parallel=False)[1]] == ["add"]  # (parallel_tool_calls)
    for text in (f"```json\n{one}\nThen I will subtract.\n```", f'[{one}, {{"name": "mul", "arguments": {{}}}}]',
                 f"[{one}, 3]", "[]", f"{one}\n{{not json"):  # anything else in it: all content
        assert ToolFormat.parse(text, names=names) == (text, []), text


def test_a_call_in_the_templates_doubled_braces_is_a_call():
    """Qwen2.5's template shows {{"name": ..., "arguments": ...}}; its models copy it now and then."""
    doubled = '{{"name": "add", "arguments": {"a": 1, "b": 2}}}'
    for text in (doubled, f"```json\n{doubled}\n```", f"<tool_call>\n{doubled}\n</tool_call>"):
        content, calls = ToolFormat.parse(text, names=("add",))
        assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})], text
    assert ToolFormat.parse('{{"a": 1}}', names=("add",)) == ('{{"a": 1}}', [])  # (not a call: content)


class _Tok:  # what CallStream needs of a tokenizer: decode of ids that are characters here
    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))


def test_streamed_content_stops_where_a_call_begins():
    fmt = ToolFormat.__new__(ToolFormat)
    fmt.tokenizer = _Tok()
    stream = CallStream(fmt, ())
    text = 'Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    out = "".join(stream.push([ord(ch)]) for ch in text)
    rest, calls = stream.finish()
    assert out + rest == "Sure. " and "<" not in out and [c.name for c in calls] == ["add"]
    stream = CallStream(fmt, (), ("add",))
    text = '```json\n{"name": "add", "arguments": {"a": 1}}\n```'
    assert "".join(stream.push([ord(ch)]) for ch in text) == ""  # held back: it may be a bare call
    assert stream.finish()[0] == "" and stream.finish()[1][0].name == "add"
    stream = CallStream(fmt, (), ("add",))
    text = '[{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": {"a": 2}}]'
    assert "".join(stream.push([ord(ch)]) for ch in text) == ""  # a list of calls is held back too
    assert [json.loads(c.arguments)["a"] for c in stream.finish()[1]] == [1, 2]
    stream = CallStream(fmt, (), ("add",))
    assert "".join(stream.push([ord(ch)]) for ch in "Hello there") == "Hello there"
    stream = CallStream(fmt, (), ("add",))
    assert "".join(stream.push([ord(ch)]) for ch in "[a link](x) here") == "[a link](x) here"


def test_the_required_grammar_takes_every_form_the_parser_reads_and_ends_after_one_json_call(llm):
    """Blocks (several where parallel calls are allowed), or one call in a ```json fence or as
    bare JSON, after which nothing more is allowed: a model that writes its one call as JSON
    ends there instead of being forced into blocks it does not know how to stop."""
    grammar = llm.tool_format.grammar(Tools.check(TOOLS, "required", True))
    call = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    for text, ends in ((f"```json\n{call}\n```", True), (call, True), (f"```\n{call}\n```", True),
                       (f"<tool_call>\n{call}\n</tool_call>", False)):  # a block may be followed by another
        c = llm.engine.grammars.compile(SamplingParams(grammar=grammar))
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        c.follow(ids)
        assert len(c.consumed) == len(ids) and c.stopped == ends, text
        assert ToolFormat.parse(text, names=("add",))[1][0].name == "add"
    bad = llm.engine.grammars.compile(SamplingParams(grammar=grammar))
    with pytest.raises(RuntimeError, match="broke the grammar"):
        bad.follow(llm.tokenizer.encode('```json\n{"name": "sub"', add_special_tokens=False))


def test_required_and_named_calls_always_validate(llm):
    for choice, parallel in (("required", True), ("required", False), ({"type": "function", "function": {
            "name": "add"}}, True)):
        out = llm.generate(ASK, SamplingParams.greedy(max_tokens=80), tools=Tools.check(TOOLS, choice, parallel))[0]
        # In parallel a small model may go on calling until max_tokens: the calls it finished stand.
        ended = ("tool_calls", "length") if parallel and choice == "required" else ("tool_calls",)
        assert out.finish_reason in ended and valid(out.tool_calls), (choice, out.text, out.tool_calls)
        if isinstance(choice, dict):
            assert {c.name for c in out.tool_calls} == {"add"}
        if not parallel:
            assert len(out.tool_calls) == 1
    free = llm.generate(ASK, SamplingParams.greedy(max_tokens=40), tools=Tools.check(TOOLS, "none"))[0]
    assert free.tool_calls is None and free.finish_reason in ("stop", "length")


def test_a_tool_round_trip_and_the_stream(llm):
    tools = Tools.check(TOOLS, "required", False)
    out = llm.generate(ASK, SamplingParams.greedy(max_tokens=80), tools=tools)[0]
    call = out.tool_calls[0]
    chunks = list(llm.stream(ASK, SamplingParams.greedy(max_tokens=80), tools=tools))
    assert "".join(c.text for c in chunks) == out.text and chunks[-1].finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in chunks[-1].tool_calls] == [(call.name, call.arguments)]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    answer = llm.generate(history, SamplingParams.greedy(max_tokens=24), tools=TOOLS)[0]
    assert answer.token_ids and "<tool_response>" in answer.prompt and '"temperature": 21' in answer.prompt


@pytest.mark.parametrize("mode", ["sd", "ngram", "ssd"])
def test_tool_grammar_is_exact_in_every_mode(tool_model, truncated_draft, llm, mode):
    tools = Tools.check(TOOLS, "required", True)
    want = llm.generate(ASK, SamplingParams.greedy(max_tokens=80), tools=tools)[0]
    draft = "ngram" if mode == "ngram" else truncated_draft
    with LLM(tool_model, draft=draft, mode="ssd" if mode == "ssd" else "sd", speculate_k=4) as spec:
        out = spec.generate(ASK, SamplingParams.greedy(max_tokens=80), tools=tools)[0]
    assert out.token_ids == want.token_ids and out.finish_reason == want.finish_reason


def test_a_model_without_tool_support_says_so(smollm):
    with pytest.raises(ToolError, match="no tool support"):
        smollm.new_request(ASK, SamplingParams(), tools=TOOLS)
    with pytest.raises(PromptError, match="no tool support"):
        smollm.new_request(ASK + [{"role": "tool", "content": "x"}], SamplingParams())
    with pytest.raises(ToolError, match="plain prompt"):
        smollm.new_request("Hi", SamplingParams(), tools=TOOLS)


def test_tool_choice_and_a_constraint_conflict(llm):
    with pytest.raises(ToolError, match="cannot also follow"):
        llm.new_request(ASK, SamplingParams(json_schema={"type": "object"}), tools=Tools.check(TOOLS, "required"))
    with pytest.raises(PromptError, match="arguments must be a JSON object"):
        llm.new_request(ASK + [{"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": "[1]"}}]}], SamplingParams())
