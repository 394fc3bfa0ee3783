"""`ssd serve`'s Anthropic Messages API (POST /v1/messages) through the official `anthropic`
client: answers equal LLM.generate's, streams assemble to the whole answer, stop sequences,
prefix-cache usage, tools, and errors in Anthropic's shape."""
import json

import anthropic
import httpx
import jsonschema
import pytest

from serving import start_server
from ssd import SamplingParams

KEY = "anthropic-key"
GREEDY = {"extra_body": {"temperature": 0}}  # the client of today no longer names temperature
SYSTEM = "You are a terse assistant who answers questions about animals in one sentence. " * 5
ADD = {"name": "add", "description": "Add two integers",
       "input_schema": {"type": "object", "required": ["a", "b"], "additionalProperties": False,
                        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}


@pytest.fixture(scope="module")
def server(tool_model, tmp_path_factory):
    """SmolLM2 with Qwen2.5's template, which renders tools."""
    s = start_server("--model", str(tool_model), "--served-model-name", "m", "--api-key", KEY,
                     tmp_path=tmp_path_factory.mktemp("anthropic"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def test_a_message_equals_generate(client, tool_llm):
    r = client.messages.create(model="m", max_tokens=24, **GREEDY, system=SYSTEM,
                               messages=[{"role": "user", "content": "What do cats eat?"}])
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What do cats eat?"}]
    want = tool_llm.generate([chat], SamplingParams.greedy(max_tokens=24))[0]
    assert r.type == "message" and r.role == "assistant" and r.model == "m" and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == want.text
    assert r.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[want.finish_reason]
    u = r.usage
    assert u.input_tokens + u.cache_read_input_tokens == want.metrics.prompt_tokens
    assert u.output_tokens == len(want.token_ids)


def test_a_shared_system_prompt_is_read_from_the_cache(client):
    ask = lambda q: client.messages.create(model="m", max_tokens=4, **GREEDY, system=SYSTEM,  # noqa: E731
                                           messages=[{"role": "user", "content": q}])
    ask("Do dogs swim?")
    u = ask("Do owls sleep?").usage
    assert u.cache_read_input_tokens >= 64 and u.input_tokens > 0 and u.cache_creation_input_tokens == 0


def test_a_tenant_reads_only_its_own_cached_prompts(client):
    ask = lambda q, salt: client.messages.create(  # noqa: E731
        model="m", max_tokens=2, system=SYSTEM, messages=[{"role": "user", "content": q}],
        extra_body={**GREEDY["extra_body"], "cache_salt": salt}).usage.cache_read_input_tokens
    assert ask("Do cats swim?", "t1") == 0 and ask("Do cows swim?", "t2") == 0 and ask("Do bats swim?", "t1") >= 64


def test_a_stream_assembles_to_the_message(client):
    kw = dict(model="m", max_tokens=30, **GREEDY, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Name two birds.", "cache_control": {"type": "ephemeral"}}]}])
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_the_raw_event_sequence(server):
    body = {"model": "m", "max_tokens": 8, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Hello"}]}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}) as r:
        kinds = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}


def test_a_stop_sequence_is_named(client):
    r = client.messages.create(model="m", max_tokens=40, **GREEDY, stop_sequences=["e"],
                               messages=[{"role": "user", "content": "Describe the sea."}])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "e" and "e" not in r.content[0].text


def test_a_tool_round_trip(client):
    ask = [{"role": "user", "content": "What is 17 plus 25? Use the add tool."}]
    r = client.messages.create(model="m", max_tokens=60, **GREEDY, tools=[ADD],
                               tool_choice={"type": "tool", "name": "add"}, messages=ask)
    assert r.stop_reason == "tool_use"
    call = r.content[-1]
    assert call.type == "tool_use" and call.name == "add" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, ADD["input_schema"])
    history = ask + [{"role": "assistant", "content": [b.model_dump() for b in r.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "42"}]}]
    final = client.messages.create(model="m", max_tokens=20, **GREEDY, tools=[ADD],
                                   tool_choice={"type": "none"}, messages=history)
    assert final.content[0].type == "text" and final.content[0].text
    with client.messages.stream(model="m", max_tokens=60, **GREEDY, tools=[ADD], tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                messages=ask) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and streamed.content[-1].input == call.input


@pytest.mark.parametrize("body, status, kind, says", [
    ({"messages": [{"role": "user", "content": "Hi"}], "model": "m"}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 5, "model": "m", "messages": []}, 400, "invalid_request_error", "messages"),
    ({"max_tokens": 5, "model": "m", "messages": [{"role": "system", "content": "x"}]}, 400,
     "invalid_request_error", "role"),
    ({"max_tokens": 5, "model": "m", "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]}, 400,
     "invalid_request_error", "image"),
    ({"max_tokens": 5, "model": "m", "thinking": {"type": "enabled"}, "messages": [{"role": "user", "content": "Hi"}]},
     400, "invalid_request_error", "thinking"),
    ({"max_tokens": 5, "model": "m", "temperature": -1, "messages": [{"role": "user", "content": "Hi"}]}, 400,
     "invalid_request_error", "temperature"),
    ({"max_tokens": 5, "model": "m", "tools": [ADD], "tool_choice": {"type": "tool", "name": "mul"},
      "messages": [{"role": "user", "content": "Hi"}]}, 400, "invalid_request_error", "mul"),
    ({"max_tokens": 5, "model": "other", "messages": [{"role": "user", "content": "Hi"}]}, 404, "not_found_error",
     "other"),
    ({"max_tokens": 100000, "model": "m", "messages": [{"role": "user", "content": "Hi"}]}, 400,
     "invalid_request_error", "context"),
])
def test_bad_requests_answer_in_anthropic_shape(server, body, status, kind, says):
    r = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == kind and says in err["error"]["message"]


def test_the_key_is_required(server):
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert json.loads(e.value.response.text)["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/health").status_code == 200  # still serving


def test_count_tokens_counts_what_the_model_reads(client, tool_llm):
    messages = [{"role": "user", "content": "What is 17 plus 25? Use the add tool."}]
    n = client.messages.count_tokens(model="m", system=SYSTEM, tools=[ADD], messages=messages).input_tokens
    chat = [{"role": "system", "content": SYSTEM}] + messages
    tools = [{"type": "function", "function": {"name": "add", "description": ADD["description"],
                                                "parameters": ADD["input_schema"]}}]
    assert n == len(tool_llm.encode(chat, tools)) and n > len(tool_llm.encode(chat))  # (the tools are read too)
    r = client.messages.create(model="m", max_tokens=1, **GREEDY, system=SYSTEM, tools=[ADD], messages=messages)
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == n
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):  # not a field of count_tokens
        client.messages.count_tokens(model="m", messages=messages, extra_body={"max_tokens": 5})
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="other", messages=messages)


def test_a_failed_tool_result_reaches_the_model(server, tool_llm):
    """is_error: chat templates have no field for it, so the tool message's content says it."""
    def prompt_tokens(is_error: bool) -> int:
        block = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "division by zero", "is_error": is_error}
        body = {"model": "m", "messages": [
            {"role": "user", "content": "Divide 1 by 0 with the div tool."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "add",
                                               "input": {"a": 1, "b": 0}}]},
            {"role": "user", "content": [block]}]}
        r = httpx.post(server.url + "/v1/messages/count_tokens", json=body, headers={"x-api-key": KEY}, timeout=60)
        return r.json()["input_tokens"]

    def chat(result: str) -> list[dict]:
        call = {"id": "toolu_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 0}'}}
        return [{"role": "user", "content": "Divide 1 by 0 with the div tool."},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "toolu_1", "content": result}]
    assert prompt_tokens(False) == len(tool_llm.encode(chat("division by zero")))
    assert prompt_tokens(True) == len(tool_llm.encode(chat("Error: division by zero")))
    r = httpx.post(server.url + "/v1/messages/count_tokens", headers={"x-api-key": KEY}, timeout=60, json={
        "model": "m", "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": "x", "is_error": "yes"}]}]})
    assert r.status_code == 400 and "is_error" in r.json()["error"]["message"]


def test_every_route_under_messages_answers_in_anthropic_shape(server):
    routes = (("POST", "/v1/messages/batches"), ("GET", "/v1/messages"), ("GET", "/v1/messages/count_tokens"))
    for method, path in routes:
        r = httpx.request(method, server.url + path, headers={"x-api-key": KEY}, timeout=60)
        assert r.status_code in (404, 405), r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] in ("not_found_error", "invalid_request_error")
    r = httpx.post(server.url + "/v1/chat/completions/x", timeout=60)  # (OpenAI's routes keep OpenAI's shape)
    assert r.status_code == 404 and "error" in r.json() and "type" not in r.json()
