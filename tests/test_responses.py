"""`ssd serve`'s Responses API (POST /v1/responses) through the official `openai` client and the
openai-agents SDK: answers equal LLM.generate's, streams assemble to the same response, a tool
round trip, follow-ups by previous_response_id, kept responses, structured output, and errors."""
import asyncio
import json

import agents
import httpx
import jsonschema
import openai
import pytest

from serving import start_server
from ssd import SamplingParams

KEY = "responses-key"
ADD = {"type": "function", "name": "add", "description": "Add two integers", "strict": True,
       "parameters": {"type": "object", "required": ["a", "b"], "additionalProperties": False,
                      "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}
ASK = "What is 17 plus 25? Use the add tool."


@pytest.fixture(scope="module")
def server(tool_model, tmp_path_factory):
    """SmolLM2 with Qwen2.5's template, which renders tools."""
    s = start_server("--model", str(tool_model), "--served-model-name", "m", "--api-key", KEY,
                     tmp_path=tmp_path_factory.mktemp("responses"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


def _greedy(tool_llm, chat, max_tokens, tools=None):
    return tool_llm.generate([chat], SamplingParams.greedy(max_tokens=max_tokens), tools=tools)[0]


def test_a_response_equals_generate(client, tool_llm):
    r = client.responses.create(model="m", instructions="Answer in one sentence.", input="What do cats eat?",
                                max_output_tokens=24, temperature=0)
    want = _greedy(tool_llm, [{"role": "system", "content": "Answer in one sentence."},
                           {"role": "user", "content": "What do cats eat?"}], 24)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "m"
    assert r.output_text == want.text and [i.type for i in r.output] == ["message"]
    assert r.status == ("incomplete" if want.finish_reason == "length" else "completed")
    assert r.usage.input_tokens == want.metrics.prompt_tokens and r.usage.output_tokens == len(want.token_ids)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert client.responses.retrieve(r.id).output_text == r.output_text  # kept


def test_a_stream_assembles_to_the_response(client, server):
    kw = dict(model="m", input="Name three birds.", max_output_tokens=20, temperature=0)
    whole = client.responses.create(**kw)
    kinds, deltas, final = [], [], None
    with client.responses.stream(**kw) as stream:  # (cut by max_output_tokens: response.incomplete, as OpenAI's)
        for e in stream:
            kinds.append(e.type)
            if e.type == "response.output_text.delta":
                deltas.append(e.delta)
            if e.type in ("response.completed", "response.incomplete"):
                final = e.response
    assert final.status == whole.status and final.usage.output_tokens == whole.usage.output_tokens
    assert final.output_text == whole.output_text == "".join(deltas)
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in (
        "response.completed", "response.incomplete")
    assert kinds.index("response.output_item.added") < kinds.index("response.content_part.added") \
        < kinds.index("response.output_text.delta") < kinds.index("response.output_text.done") \
        < kinds.index("response.content_part.done") < kinds.index("response.output_item.done")
    raw = httpx.post(server.base_url + "/responses", json={**kw, "stream": True}, timeout=60,
                     headers={"Authorization": f"Bearer {KEY}"}).text
    numbers = [json.loads(line[6:])["sequence_number"] for line in raw.splitlines() if line.startswith("data: ")]
    assert numbers == list(range(len(numbers)))


def test_a_tool_round_trip_and_a_follow_up(client, tool_llm):
    first = client.responses.create(model="m", input=ASK, tools=[ADD], tool_choice="required", temperature=0,
                                    max_output_tokens=60)
    (call,) = [i for i in first.output if i.type == "function_call"]
    assert call.name == "add" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), ADD["parameters"])
    # The follow-up by previous_response_id reads the same prompt as the whole history sent again.
    by_id = client.responses.create(model="m", previous_response_id=first.id, tools=[ADD], temperature=0,
                                    max_output_tokens=20, input=[{"type": "function_call_output",
                                                                  "call_id": call.call_id, "output": "42"}])
    by_items = client.responses.create(model="m", tools=[ADD], temperature=0, max_output_tokens=20, store=False,
                                       input=[{"role": "user", "content": ASK}, call.model_dump(),
                                              {"type": "function_call_output", "call_id": call.call_id,
                                               "output": "42"}])
    assert by_id.output_text == by_items.output_text and by_id.usage.input_tokens == by_items.usage.input_tokens
    history = [{"role": "user", "content": ASK},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.call_id, "type": "function", "function": {"name": "add", "arguments": call.arguments}}]},
               {"role": "tool", "tool_call_id": call.call_id, "content": "42"}]
    want = _greedy(tool_llm, history, 20, tools=[{"type": "function", "function": {
        k: v for k, v in ADD.items() if k != "type"}}])
    assert by_id.output_text == want.text
    with pytest.raises(openai.NotFoundError):  # store: false keeps nothing
        client.responses.retrieve(by_items.id)
    streamed = client.responses.create(model="m", input=ASK, tools=[ADD], tool_choice="required", temperature=0,
                                       max_output_tokens=60, stream=True)
    kinds, done = [], None
    for e in streamed:
        kinds.append(e.type)
        done = e.response if e.type == "response.completed" else done
    assert "response.function_call_arguments.done" in kinds
    assert [i.arguments for i in done.output if i.type == "function_call"] == [call.arguments]


def test_structured_output_follows_the_schema(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "legs": {"type": "integer"}},
              "required": ["name", "legs"], "additionalProperties": False}
    r = client.responses.create(model="m", input="Describe a spider as JSON.", temperature=0, max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "animal", "schema": schema,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_kept_responses_are_deleted_and_bounded(client):
    r = client.responses.create(model="m", input="Hi", max_output_tokens=2)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        client.responses.create(model="m", input="Hi", previous_response_id=r.id, max_output_tokens=2)


def test_a_responses_input_items_are_listed_and_paged(client):
    given = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": [{"type": "input_text",
                                                                                      "text": "Name a fruit."}]}]
    r = client.responses.create(model="m", input=given, max_output_tokens=4)
    page = client.responses.input_items.list(r.id)  # newest first, as OpenAI's default
    assert [(i.role, i.content[0].text) for i in page.data] == [
        ("user", "Name a fruit."), ("assistant", "Hello!"), ("user", "Hi"), ("system", "Be brief.")]
    assert page.data[1].content[0].type == "output_text" and all(i.status == "completed" for i in page.data)
    walked = [i.id for i in client.responses.input_items.list(r.id, order="asc", limit=1)]  # the SDK pages on
    assert walked == [i.id for i in reversed(page.data)]
    follow = client.responses.create(model="m", input="And a vegetable?", previous_response_id=r.id,
                                     max_output_tokens=4)
    assert [i.content[0].text for i in client.responses.input_items.list(follow.id)] == ["And a vegetable?"]
    with pytest.raises(openai.BadRequestError, match="limit"):
        client.responses.input_items.list(r.id, limit=500)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")


def test_store_evicts_the_oldest():
    from ssd.serving.responses_protocol import ResponseStore
    store = ResponseStore(most=2)
    for i in range(3):
        store.keep({"id": f"r{i}"}, [{"role": "user", "content": str(i)}], "ok", None)
    assert list(store.kept) == ["r1", "r2"]
    assert store.conversation("r2") == [{"role": "user", "content": "2"}, {"role": "assistant", "content": "ok"}]


@pytest.mark.parametrize("extra, param, says", [
    ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]", "web_search"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0]", "input_image"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]",
     "input_image"),
    ({"max_output_tokens": 0}, "max_output_tokens", "at least 1"),
    ({"max_output_tokens": 100_000}, "max_output_tokens", "maximum context length"),
    ({"text": {"format": {"type": "xml"}}}, "text.format", "format"),
    ({"frequency_penalty": 1}, "frequency_penalty", "frequency_penalty"),
    ({"temperature": -1}, "temperature", "temperature"),
    ({"truncation": "auto"}, "truncation", "truncation"),
])
def test_bad_requests_name_the_field(client, extra, param, says):
    body = {"model": "m", "input": "Hi", **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**body) if "frequency_penalty" not in extra else \
            client.responses.create(model="m", input="Hi", extra_body=extra)
    assert e.value.body["param"] == param and says in e.value.body["message"], e.value.body


def test_the_agents_sdk_runs_a_function_tool(server):
    """openai-agents' default agent loop (the Responses API) with one function tool, end to end."""
    calls = []

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    client = openai.AsyncOpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)
    model = agents.OpenAIResponsesModel(model="m", openai_client=client)
    agent = agents.Agent(name="calc", instructions="Use the add tool for sums.", tools=[add], model=model,
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=60, temperature=0),
                         tool_use_behavior="stop_on_first_tool")
    agents.set_tracing_disabled(True)
    result = asyncio.run(agents.Runner.run(agent, ASK))
    assert len(calls) == 1 and result.final_output == str(sum(calls[0]))
