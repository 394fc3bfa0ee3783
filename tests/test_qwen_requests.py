"""What apps send, on the default Qwen pair: tool calls with tool_choice "auto" and "required",
and JSON schemas, with SD giving AR's tokens. Slow (minutes on 2 CPU cores): run by hand with
`python -m pytest -m slow tests/test_qwen_requests.py`."""
import json

import jsonschema
import pytest

from ssd import LLM, SamplingParams
from ssd.tools import Tools
from serving import start_server

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
pytestmark = pytest.mark.slow


def fn(name: str, description: str, properties: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}}}


TOOLS = [fn("get_weather", "The current weather in a city", {"city": {"type": "string"}}),
         fn("add", "Add two numbers", {"a": {"type": "number"}, "b": {"type": "number"}}),
         fn("search_web", "Search the web", {"query": {"type": "string"}}),
         fn("send_email", "Send an email", {"to": {"type": "string"}, "subject": {"type": "string"},
                                            "body": {"type": "string"}})]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASKS = ["What's the weather in Tokyo right now?", "Add 1234 and 5678 with the add tool.",
        "Search the web for the latest Python release.", "Email bob@example.com that the meeting moved to 3pm.",
        "Is it raining in London?", "What is 3.5 plus 7.25? Use the tool.", "Look up who won the 2022 World Cup.",
        "Send an email to alice@example.com with subject Hi and body Hello Alice.",
        "How warm is it in Cairo today?", "Use the add tool to add 19 and 23."]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "languages"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}}


@pytest.fixture(scope="module")
def llm():
    with LLM(TARGET, draft=DRAFT, mode="sd") as llm:
        yield llm


def test_auto_and_required_tool_calls(llm):
    chats = [[{"role": "user", "content": a}] for a in ASKS]
    auto = llm.generate(chats, SamplingParams.greedy(max_tokens=96), tools=TOOLS)
    called = [o for o in auto if o.tool_calls]
    # Every call the model wrote is parsed (a call left in the text would show its name there).
    assert all(not any(f'"{n}"' in o.text for n in SCHEMAS) for o in auto if not o.tool_calls), \
        [o.text for o in auto]
    assert len(called) >= 8, [o.text for o in auto]
    required = llm.generate(chats, SamplingParams.greedy(max_tokens=96), tools=Tools.check(TOOLS, "required", False))
    for o in required:
        assert o.finish_reason == "tool_calls" and len(o.tool_calls) == 1
        c = o.tool_calls[0]
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])


def test_schema_sd_equals_ar(llm):
    chat = [{"role": "user", "content": "Describe a programmer named Ada, 36, who knows three languages, as JSON."}]
    params = SamplingParams.greedy(max_tokens=80, json_schema=PERSON, logprobs=1)
    sd = llm.generate(chat, params)[0]
    with LLM(TARGET) as ar:
        want = ar.generate(chat, params)[0]
    assert sd.token_ids == want.token_ids and sd.logprobs == want.logprobs
    jsonschema.validate(json.loads(sd.text), PERSON)
    assert sd.metrics.acceptance_rate > 0.5


WEATHER = fn("get_weather", "Get the current weather in a city", {"city": {"type": "string"},
                                                                  "unit": {"type": "string",
                                                                           "enum": ["celsius", "fahrenheit"]}})


def test_required_through_the_server_calls_once_and_finishes_with_tool_calls(tmp_path):
    """tool_choice "required" from the official client, parallel calls allowed (its default):
    the model's one call and its end, streamed and not (it used to repeat the call until
    max_tokens)."""
    openai = pytest.importorskip("openai")
    server = start_server("--model", TARGET, "--draft", DRAFT, "--mode", "sd", tmp_path=tmp_path, timeout=600)
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="none")
        ask = dict(model=TARGET, messages=[{"role": "user", "content": "What's the weather in Oslo right now? Use "
                                                                       "Celsius."}],
                   tools=[WEATHER], tool_choice="required", max_tokens=120, temperature=0)
        r = client.chat.completions.create(**ask)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Oslo", "unit": "celsius"}
        chunks = list(client.chat.completions.create(**ask, stream=True))
        deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
        assert [d.function.name for d in deltas if d.function.name] == ["get_weather"]
        assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    finally:
        server.stop()


def test_two_calls_in_one_answer_are_two_tool_calls(llm):
    """Asked for two things at once, the 1.5B writes two calls in one answer (two objects in
    one json fence, unconstrained): both come back as tool calls, and with
    parallel_tool_calls false the first alone."""
    chat = [{"role": "user", "content": "Check the weather in Berlin and in Rome."}]
    out = llm.generate(chat, SamplingParams.greedy(max_tokens=150), tools=TOOLS)[0]
    assert out.finish_reason == "tool_calls", out.text
    assert [(c.name, json.loads(c.arguments)["city"]) for c in out.tool_calls] == \
        [("get_weather", "Berlin"), ("get_weather", "Rome")], out.text
    one = llm.generate(chat, SamplingParams.greedy(max_tokens=150), tools=Tools.check(TOOLS, "auto", False))[0]
    assert [json.loads(c.arguments)["city"] for c in one.tool_calls] == ["Berlin"]


def test_an_agent_runs_a_tool_through_the_responses_api(tmp_path):
    """openai-agents' default agent loop (tool_choice auto) on the default pair in SD: the model
    calls the tool and the SDK runs it. (Given the tool's result, the 1.5B calls it again,
    greedy, whatever the system prompt: the loop stops at the first call.)"""
    import asyncio

    import agents
    import openai
    server = start_server("--model", TARGET, "--draft", DRAFT, "--mode", "sd", tmp_path=tmp_path, timeout=600)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"{city}: 17 degrees Celsius, light rain"

    try:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="none", timeout=600)
        agent = agents.Agent(name="weather", instructions="Answer with the tools you have.", tools=[get_weather],
                             model=agents.OpenAIResponsesModel(model=TARGET, openai_client=client),
                             model_settings=agents.ModelSettings(temperature=0, max_tokens=120),
                             tool_use_behavior="stop_on_first_tool")
        agents.set_tracing_disabled(True)
        result = asyncio.run(agents.Runner.run(agent, "What's the weather in Oslo right now?"))
        assert calls == ["Oslo"] and result.final_output == "Oslo: 17 degrees Celsius, light rain"
    finally:
        server.stop()
