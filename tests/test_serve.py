"""`ssd serve` through the official openai client and raw HTTP, on SmolLM2, as a subprocess."""
import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from serving import start_server
from ssd import SamplingParams

KEY = "test-key-123"
MODEL = "smollm2-135m-instruct"
QUESTIONS = [f"In one sentence: {topic}?" for topic in (
    "what is a prime number", "why is the sky blue", "what does a compiler do", "who wrote Hamlet",
    "what is photosynthesis", "how do magnets work", "what is an atom", "why do we sleep",
    "what is gravity", "how does a bicycle stay up", "what is inflation", "what is DNA",
    "why is the sea salty", "what is a black hole", "how do vaccines work", "what is a neural network",
    "what is the speed of light", "how do bees make honey", "what is a volcano", "why do leaves change colour",
    "what is democracy", "how does a rainbow form", "what is an algorithm", "what causes tides",
    "what is electricity", "how do planes fly", "what is a galaxy", "why do cats purr",
    "what is climate", "how does the heart pump blood", "what is a fraction", "what is friction")]


def chat(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server("--model", MODEL, "--api-key", KEY, "--max-num-seqs", "16",
                     tmp_path=tmp_path_factory.mktemp("serve"))
    yield s
    assert s.stop() == 0 or s.proc.returncode in (-signal.SIGTERM,)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def sequential(smollm):
    """Each question's greedy output, generated alone in this process."""
    cache = {}

    def run(q: str, max_tokens: int) -> str:
        if (q, max_tokens) not in cache:
            cache[q, max_tokens] = smollm.generate(chat(q), SamplingParams.greedy(max_tokens=max_tokens))[0].text
        return cache[q, max_tokens]
    return run


def test_chat_greedy_equals_generate(client, sequential):
    r = client.chat.completions.create(model=MODEL, messages=chat(QUESTIONS[0]), temperature=0, max_tokens=24)
    assert r.choices[0].message.content == sequential(QUESTIONS[0], 24)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.model_extra["ssd_metrics"]["mode"] == "ar"


def test_chat_streamed_equals_not_streamed(client, sequential):
    stream = client.chat.completions.create(model=MODEL, messages=chat(QUESTIONS[1]), temperature=0, max_tokens=24,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == sequential(QUESTIONS[1], 24)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_completions_streamed_and_not(client, smollm):
    prompt = "The three primary colours are"
    expected = smollm.generate(prompt, SamplingParams.greedy(max_tokens=20))[0].text
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=20)
    assert r.choices[0].text == expected and r.object == "text_completion"
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=20, stream=True) if c.choices)
    assert text == expected
    assert client.completions.create(model=MODEL, prompt=prompt).usage.completion_tokens <= 16  # OpenAI's default


def test_stop_strings(client, sequential):
    full = sequential(QUESTIONS[2], 24)
    word = full.split()[3]
    for stop in (word, [word, "zzzz"]):
        r = client.chat.completions.create(model=MODEL, messages=chat(QUESTIONS[2]), temperature=0, max_tokens=24,
                                           stop=stop)
        assert r.choices[0].finish_reason == "stop"
        assert r.choices[0].message.content == full[:full.index(word)]


def test_seed_reproducible(client):
    def sample(seed):
        return client.chat.completions.create(model=MODEL, messages=chat("Tell me a story."), temperature=1.0,
                                              max_tokens=24, seed=seed).choices[0].message.content
    a = sample(7)
    assert sample(7) == a
    assert sample(8) != a or sample(9) != a


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list()] == [MODEL]
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.owned_by == "ssd-engine"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.code == "model_not_found" and "no-such-model" in e.value.message
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


@pytest.mark.parametrize("kwargs, status, param, code", [
    (dict(temperature=-1), 400, "temperature", None),
    (dict(top_p=0), 400, "top_p", None),
    (dict(max_tokens=0), 400, "max_tokens", None),
    (dict(stop=[""]), 400, "stop", None),
    (dict(n=0), 400, "n", None),
    (dict(n=17), 400, "n", None),
    (dict(logprobs=True, top_logprobs=21), 400, "top_logprobs", None),
    (dict(top_logprobs=2), 400, "top_logprobs", None),
    (dict(logprobs=1), 400, "logprobs", None),
    (dict(presence_penalty=2.5), 400, "presence_penalty", None),
    (dict(frequency_penalty="a lot"), 400, "frequency_penalty", None),
    (dict(logit_bias={"99999999": 1}), 400, "logit_bias", None),
    (dict(logit_bias={"5": 1e9}), 400, "logit_bias", None),
    (dict(logit_bias={"five": 1}), 400, "logit_bias", None),
    (dict(extra_body={"min_tokens": 9}), 400, "min_tokens", None),
    (dict(extra_body={"repetition_penalty": 0}), 400, "repetition_penalty", None),
    (dict(extra_body={"min_p": 2}), 400, "min_p", None),
    (dict(response_format={"type": "xml"}), 400, "response_format", None),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}),
     400, "response_format", None),
    (dict(response_format={"type": "json_schema", "json_schema": "x"}), 400, "response_format", None),
    (dict(response_format={"type": "json_object"}, extra_body={"regex": "a+"}), 400, "response_format", None),
    (dict(extra_body={"regex": "(("}), 400, "regex", None),
    (dict(extra_body={"grammar": 'start: "a" b'}), 400, "grammar", None),
    (dict(extra_body={"json_schema": {"type": "integer", "minimum": 3, "maximum": 1}}), 400, "json_schema", None),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), 400, "tools", None),
    (dict(tool_choice="required"), 400, "tool_choice", None),
    (dict(extra_body={"mirostat": 2}), 400, "mirostat", None),
    (dict(max_tokens=10_000), 400, "max_tokens", "context_length_exceeded"),
    (dict(model="gpt-4o"), 404, "model", "model_not_found"),
    (dict(messages=[]), 400, "messages", None),
    (dict(messages=[{"role": "function", "content": "x"}]), 400, "messages[0].role", None),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "messages[0].content", None),
])
def test_errors_in_openai_shape(client, kwargs, status, param, code):
    request = dict(model=MODEL, messages=chat("Hi"), max_tokens=8) | kwargs
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(**request)
    e = info.value
    assert e.status_code == status
    assert e.body["param"] == param and e.body["code"] == code and e.body["message"]
    assert e.body["type"] == "invalid_request_error"


# ---- what apps send: schemas, logprobs, penalties, n -----------------------------------
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}}}
ABOUT_BOB = chat("Describe Bob, who is 42 and lives in Paris, as JSON.")


def test_json_schema_equals_generate_and_validates(client, smollm):
    import jsonschema
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=ABOUT_BOB, temperature=0, max_tokens=60,
                                       response_format=fmt)
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    assert r.choices[0].finish_reason == "stop"
    assert text == smollm.generate(ABOUT_BOB, SamplingParams.greedy(max_tokens=60, json_schema=PERSON))[0].text
    r = client.chat.completions.create(model=MODEL, messages=ABOUT_BOB, temperature=0, max_tokens=60,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    cut = client.chat.completions.create(model=MODEL, messages=ABOUT_BOB, temperature=0, max_tokens=5,
                                         response_format=fmt)
    assert cut.choices[0].finish_reason == "length"


def test_parse_into_a_pydantic_model(client):
    import pydantic

    class Person(pydantic.BaseModel):
        name: str
        age: int
        city: str
    r = client.chat.completions.parse(model=MODEL, messages=ABOUT_BOB, temperature=0, max_tokens=60,
                                      response_format=Person)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and person.name


def test_logprobs_streamed_and_not(client, smollm):
    want = smollm.generate(chat(QUESTIONS[1]), SamplingParams.greedy(max_tokens=12, logprobs=3))[0]
    r = client.chat.completions.create(model=MODEL, messages=chat(QUESTIONS[1]), temperature=0, max_tokens=12,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == [x.logprob for x in want.logprobs]
    assert "".join(c.token for c in content) == want.text
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob for c in content)
    streamed = [c for part in client.chat.completions.create(
        model=MODEL, messages=chat(QUESTIONS[1]), temperature=0, max_tokens=12, logprobs=True, top_logprobs=3,
        stream=True) for ch in part.choices if ch.logprobs for c in ch.logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    plain = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=6,
                                      logprobs=2)
    lp = plain.choices[0].logprobs
    assert "".join(lp.tokens) == plain.choices[0].text and len(lp.token_logprobs) == 6
    assert lp.text_offset[0] == 0 and all(len(t) == 2 for t in lp.top_logprobs)


def test_penalties_and_bias_equal_generate(client, smollm):
    kw = dict(presence_penalty=1.0, frequency_penalty=0.5, logit_bias={"28": 3.0})
    r = client.chat.completions.create(model=MODEL, messages=chat(QUESTIONS[2]), temperature=0, max_tokens=24,
                                       extra_body={"min_tokens": 20, "repetition_penalty": 1.2}, **kw)
    want = smollm.generate(chat(QUESTIONS[2]), SamplingParams.greedy(
        max_tokens=24, min_tokens=20, repetition_penalty=1.2, presence_penalty=1.0, frequency_penalty=0.5,
        logit_bias={28: 3.0}))[0]
    assert r.choices[0].message.content == want.text


def test_n_choices_with_a_seed(client, smollm):
    def ask(stream=False):
        kw = dict(model=MODEL, messages=chat(QUESTIONS[3]), temperature=1.0, max_tokens=16, n=3, seed=7)
        if not stream:
            return [c.message.content for c in sorted(client.chat.completions.create(**kw).choices,
                                                      key=lambda c: c.index)]
        texts = ["", "", ""]
        for part in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
            for c in part.choices:
                texts[c.index] += c.delta.content or ""
        return texts
    texts = ask()
    assert len(texts) == 3 and len(set(texts)) > 1
    assert ask() == texts and ask(stream=True) == texts
    for i, text in enumerate(texts):  # choice i is the request with seed 7 + i
        assert text == smollm.generate(chat(QUESTIONS[3]), SamplingParams(max_tokens=16, seed=7 + i))[0].text
    one = client.chat.completions.create(model=MODEL, messages=chat(QUESTIONS[3]), max_tokens=5, n=1)
    two = client.chat.completions.create(model=MODEL, messages=chat(QUESTIONS[3]), max_tokens=5, n=2,
                                         extra_body={"ignore_eos": True})
    assert two.usage.prompt_tokens == one.usage.prompt_tokens and two.usage.completion_tokens == 10


# ---- tools, on SmolLM2 with Qwen2.5's template (tests/conftest.py tool_model) --------------
ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "required": ["a", "b"], "additionalProperties": False,
                   "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
ASK_ADD = chat("What is 17 plus 25? Use the add tool.")


@pytest.fixture(scope="module")
def tool_client(tool_model, tmp_path_factory):
    s = start_server("--model", str(tool_model), "--served-model-name", "tools", tmp_path=tmp_path_factory.mktemp("t"))
    yield openai.OpenAI(base_url=s.base_url, api_key="none", max_retries=0, timeout=120)
    s.stop()


def test_a_tool_round_trip_through_the_client(tool_client):
    import jsonschema
    r = tool_client.chat.completions.create(model="tools", messages=ASK_ADD, tools=[ADD_TOOL], temperature=0,
                                            max_tokens=60, tool_choice="required", parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "add" and call.id.startswith("call_") and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), ADD_TOOL["function"]["parameters"])
    history = ASK_ADD + [choice.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    final = tool_client.chat.completions.create(model="tools", messages=history, tools=[ADD_TOOL], temperature=0,
                                                max_tokens=20, tool_choice="none")
    assert final.choices[0].message.content and final.choices[0].finish_reason in ("stop", "length")
    named = tool_client.chat.completions.create(model="tools", messages=ASK_ADD, tools=[ADD_TOOL], temperature=0,
                                                max_tokens=60, tool_choice={"type": "function",
                                                                            "function": {"name": "add"}})
    assert named.choices[0].message.tool_calls[0].function.name == "add"


def test_streamed_tool_call_deltas_assemble_to_the_call(tool_client):
    kw = dict(model="tools", messages=ASK_ADD, tools=[ADD_TOOL], temperature=0, max_tokens=60,
              tool_choice="required", parallel_tool_calls=False)
    whole = tool_client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    calls, content, finish = {}, "", None
    for part in tool_client.chat.completions.create(stream=True, **kw):
        for c in part.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert calls == {0: {"name": whole.function.name, "arguments": whole.function.arguments}}


@pytest.mark.parametrize("kwargs, param", [
    (dict(tools=[{"type": "function", "function": {"parameters": {}}}]), "tools[0].function.name"),
    (dict(tools=[ADD_TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=[ADD_TOOL, ADD_TOOL]), "tools[1].function.name"),
    (dict(tools=[ADD_TOOL], tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
    (dict(messages=ASK_ADD + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "not json"}}]}]),
     "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_tool_requests(tool_client, kwargs, param):
    request = dict(model="tools", messages=ASK_ADD, max_tokens=8) | kwargs
    with pytest.raises(openai.BadRequestError) as info:
        tool_client.chat.completions.create(**request)
    assert info.value.body["param"] == param, info.value.body


def test_prompt_longer_than_the_context(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="word " * 9000, max_tokens=4)
    assert info.value.body["code"] == "context_length_exceeded"


def test_raw_http_errors(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.base_url + "/chat/completions", content=b"{not json", headers=auth)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(server.base_url + "/completions", json={"prompt": [[1, 2], 3]}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.get(server.base_url + "/nothing-here", headers=auth)
    assert r.status_code == 404 and "error" in r.json()


def test_api_key_required(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(server.base_url + "/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()


def load_test(server, client, sequential, questions: list[str], max_tokens: int) -> None:
    """Every client streams its own question at once; each output must equal its sequential run."""
    def one(q):
        stream = client.chat.completions.create(model=MODEL, messages=chat(q), temperature=0, max_tokens=max_tokens,
                                                stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    with ThreadPoolExecutor(len(questions)) as pool:
        outputs = list(pool.map(one, questions))
    wrong = [(q, o, sequential(q, max_tokens)) for q, o in zip(questions, outputs) if o != sequential(q, max_tokens)]
    assert not wrong, wrong[:3]
    m = server.wait_idle()  # every KV block back
    assert m.get('ssd_request_finish_total{reason="error"}', 0) == 0


def test_32_concurrent_streaming_clients(server, client, sequential):
    load_test(server, client, sequential, QUESTIONS, 24)
    m = server.metrics()
    assert m["ssd_time_to_first_token_seconds_count"] >= 32 and m["ssd_inter_token_latency_seconds_count"] > 0


def test_16_clients_sharing_a_system_prompt_get_their_cold_outputs(server, client, smollm_dir):
    """Concurrent requests that share a long system prompt (its blocks computed once, then
    shared while all 16 run) answer as each would alone on an engine without a prefix cache."""
    from ssd import LLM
    system = "You are a science teacher. Answer in one short sentence, plainly, for a child. " * 8
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in QUESTIONS[:16]]
    with LLM(smollm_dir, enable_prefix_caching=False) as cold:
        want = [cold.generate([c], SamplingParams.greedy(max_tokens=16))[0].text for c in chats]

    def one(c):
        r = client.chat.completions.create(model=MODEL, messages=c, temperature=0, max_tokens=16)
        return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, chats))
    assert [text for text, _ in got] == want
    assert sum(cached > 0 for _, cached in got) >= 15
    server.wait_idle()


def test_a_shared_prefix_is_read_from_the_cache(server, client):
    """usage.prompt_tokens_details.cached_tokens on both routes, and Prometheus' counters."""
    system = "You answer questions about the solar system, briefly and accurately. " * 6
    before = server.metrics().get("ssd_prefix_cache_hits_total", 0)
    asks = [client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": q}]) for q in ("Mars?", "Venus?")]
    cached = asks[1].usage.prompt_tokens_details.cached_tokens
    assert cached >= 64 and cached < asks[1].usage.prompt_tokens
    done = [client.completions.create(model=MODEL, prompt=system + q, max_tokens=2) for q in ("Io", "Europa")]
    assert done[1].usage.prompt_tokens_details.cached_tokens >= 64
    m = server.metrics()
    assert m["ssd_prefix_cache_hits_total"] - before >= cached + done[1].usage.prompt_tokens_details.cached_tokens
    assert m["ssd_prefix_cache_queries_total"] >= m["ssd_prefix_cache_hits_total"] and m["ssd_prefix_cache_blocks"] > 0


def test_tenants_do_not_share_the_prefix_cache(client):
    """vLLM's `cache_salt`: a request reads cached blocks of its own tenant's prompts only."""
    system = "You answer questions about rivers of Europe, briefly and accurately. " * 6

    def cached(question: str, salt: str) -> int:
        r = client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, extra_body={"cache_salt": salt},
                                           messages=[{"role": "system", "content": system},
                                                     {"role": "user", "content": question}])
        return r.usage.prompt_tokens_details.cached_tokens
    assert cached("Rhine?", "tenant-a") == 0
    assert cached("Danube?", "tenant-b") == 0  # the same system prompt, another tenant's
    assert cached("Elbe?", "tenant-a") >= 64


def disconnect_mid_stream(server, headers: dict) -> None:
    before = server.metrics().get('ssd_request_finish_total{reason="cancelled"}', 0)
    body = {"model": MODEL, "messages": chat("Write a long essay about the ocean."), "max_tokens": 2000,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base_url + "/chat/completions", json=body, headers=headers, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(8)]
        assert any(line.startswith("data: ") for line in got)
        assert server.metrics()["ssd_kv_cache_blocks_used"] > 0
    # The connection is closed: the request is cancelled and its blocks freed, long before 2000 tokens.
    m = server.wait_idle(timeout=20)
    assert m['ssd_request_finish_total{reason="cancelled"}'] == before + 1


def test_disconnect_mid_stream_cancels(server):
    disconnect_mid_stream(server, {"Authorization": f"Bearer {KEY}"})


def test_disconnect_while_waiting_for_a_whole_answer(server):
    before = server.metrics().get('ssd_request_finish_total{reason="cancelled"}', 0)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=1.5)
    # Cancelled, not run to its 2000 tokens (which could also end before the wait does).
    m = server.wait_idle(timeout=20)
    assert m['ssd_request_finish_total{reason="cancelled"}'] == before + 1


def test_full_queue_answers_429_and_sigterm_finishes_in_flight(tmp_path, smollm):
    # First, so that no generation in this process competes with the server's for the cores.
    expected = smollm.generate("Once upon a time", SamplingParams.greedy(max_tokens=200, ignore_eos=True))
    s = start_server("--model", MODEL, "--max-num-seqs", "1", "--max-queue", "1", "--shutdown-timeout", "120",
                     tmp_path=tmp_path)
    c = openai.OpenAI(base_url=s.base_url, api_key="none", max_retries=0, timeout=120)
    long = dict(model=MODEL, prompt="Once upon a time", max_tokens=200, temperature=0, extra_body={"ignore_eos": True})
    try:
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(c.completions.create, **long)
            while s.metrics()["ssd_requests_running"] < 1:
                time.sleep(0.05)
            waiting = pool.submit(c.completions.create, **long)
            while s.metrics()["ssd_requests_waiting"] < 1:
                time.sleep(0.05)
            start = time.monotonic()
            with pytest.raises(openai.RateLimitError) as info:
                c.completions.create(**long)
            assert time.monotonic() - start < 5 and info.value.body["code"] == "rate_limit_exceeded"
            # SIGTERM with two requests in flight: both finish, then the server exits.
            s.proc.send_signal(signal.SIGTERM)
            for f in (running, waiting):
                assert f.result().choices[0].text == expected[0].text
        assert s.proc.wait(60) in (0, -signal.SIGTERM)
    finally:
        s.stop(signal.SIGKILL)


@pytest.fixture(scope="module", params=["sd", "ssd"])
def spec_server(request, tmp_path_factory, truncated_draft):
    s = start_server("--model", MODEL, "--mode", request.param, "--draft", str(truncated_draft), "--k", "3",
                     "--max-num-seqs", "8", tmp_path=tmp_path_factory.mktemp(request.param))
    s.mode = request.param
    yield s
    s.stop()


def test_speculative_modes_serve_exactly(spec_server, sequential):
    c = openai.OpenAI(base_url=spec_server.base_url, api_key="none", max_retries=0, timeout=120)
    r = c.chat.completions.create(model=MODEL, messages=chat(QUESTIONS[0]), temperature=0, max_tokens=24)
    assert r.choices[0].message.content == sequential(QUESTIONS[0], 24)
    extra = r.model_extra["ssd_metrics"]
    assert extra["mode"] == spec_server.mode and extra["rounds"] > 0 and 0 <= extra["acceptance_rate"] <= 1
    if spec_server.mode == "ssd":
        assert "cache_hit_rate" in extra
    load_test(spec_server, c, sequential, QUESTIONS[:8], 16)
    m = spec_server.metrics()
    assert m["ssd_spec_rounds_total"] > 0 and m["ssd_spec_mean_accepted_length"] >= 1
    disconnect_mid_stream(spec_server, {})


def test_a_seeded_request_gets_ars_tokens_from_a_speculative_server(spec_server, smollm):
    """One seed, one answer (docs/exactness.md, "Seeded requests"): n choices with a seed from an SD
    or SSD server are plain decoding's draws with seeds 7, 8, 9, and so is choice 1 asked alone."""
    c = openai.OpenAI(base_url=spec_server.base_url, api_key="none", max_retries=0, timeout=120)
    messages = chat(QUESTIONS[3])
    r = c.chat.completions.create(model=MODEL, messages=messages, temperature=0.8, max_tokens=24, n=3, seed=7)
    want = [o.text for o in smollm.generate([messages] * 3, [SamplingParams(temperature=0.8, max_tokens=24, seed=7 + i)
                                                              for i in range(3)])]
    assert [ch.message.content for ch in sorted(r.choices, key=lambda ch: ch.index)] == want
    alone = c.chat.completions.create(model=MODEL, messages=messages, temperature=0.8, max_tokens=24, seed=8)
    assert alone.choices[0].message.content == want[1]


def test_streamed_speculation_is_opt_in_and_marks_the_drafts(spec_server, sequential):
    """stream_options.include_speculation: every step's chunk carries ssd_speculation, whose
    pieces spell the chunk's content and mark the accepted drafts, and whose steps add up to
    the answer's counters; `speculate: false` decodes the same text plainly; without the
    option, no chunk carries the field."""
    c = openai.OpenAI(base_url=spec_server.base_url, api_key="none", max_retries=0, timeout=120)
    question = "Count from 1 to 20, separated by commas."  # (the truncated draft gets some of it right)

    def run(**extra) -> tuple[str, list[dict], dict]:
        text, specs, metrics = "", [], {}
        for ch in c.chat.completions.create(model=MODEL, messages=chat(question), temperature=0, max_tokens=48,
                                            stream=True, **extra):
            spec = (ch.model_extra or {}).get("ssd_speculation")
            content = ch.choices[0].delta.content if ch.choices else None
            if spec is not None:
                assert "".join(p["text"] for p in spec["pieces"]) == (content or "")
                specs.append(spec)
            text += content or ""
            metrics.update((ch.model_extra or {}).get("ssd_metrics") or {})
            metrics.update({"tokens": ch.usage.completion_tokens} if ch.usage else {})
        return text, specs, metrics

    text, specs, m = run(stream_options={"include_speculation": True, "include_usage": True})
    assert text == sequential(question, 48)
    steps = [s["step"] for s in specs]
    assert sum(s["tokens"] for s in steps) == m["tokens"]
    assert sum(s["accepted"] for s in steps) == m["accepted"] and sum(s["drafted"] for s in steps) == m["drafted"]
    assert any(s["k"] > 0 for s in steps) and {s["source"] for s in steps} <= {None, "draft"}
    marked = "".join(p["text"] for s in specs for p in s["pieces"] if p["source"] == "draft")
    assert marked and len(marked) < len(text)
    plain_text, plain, pm = run(stream_options={"include_speculation": True}, extra_body={"speculate": False})
    assert plain_text == text and all(s["step"]["k"] == 0 for s in plain) and pm.get("drafted", 0) == 0
    assert run()[1] == [] and run(stream_options={"include_usage": True})[1] == []
    with pytest.raises(openai.BadRequestError, match="include_speculation must be a boolean"):
        run(stream_options={"include_speculation": "yes"})
    with pytest.raises(openai.BadRequestError, match="'speculate' must be bool"):
        run(extra_body={"speculate": "no"})


@pytest.mark.long
def test_sigterm_ends_the_ssd_worker(tmp_path, truncated_draft):
    s = start_server("--model", MODEL, "--mode", "ssd", "--draft", str(truncated_draft), tmp_path=tmp_path)
    try:
        workers = s.children()
        assert workers, "the SSD worker should be a child of the server"
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True, "stream": True}
        got = []

        def read():
            with httpx.stream("POST", s.base_url + "/completions", json=body, timeout=120) as r:
                got.extend(r.iter_lines())
        reader = threading.Thread(target=read)
        reader.start()
        while s.metrics()["ssd_requests_running"] < 1:
            time.sleep(0.05)
        assert s.stop(signal.SIGTERM) in (0, -signal.SIGTERM)
        reader.join(30)
        assert got[-2:] == ["data: [DONE]", ""] or got[-1] == "data: [DONE]"  # the stream in flight finished
        finals = [json.loads(x[6:]) for x in got if x.startswith("data: {")]
        assert finals[-1]["choices"][0]["finish_reason"] == "length"
        time.sleep(0.5)
        alive = [pid for pid in workers if _alive(pid)]
        assert not alive, f"orphan worker processes: {alive}"
    finally:
        s.stop(signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_prompt_is_scored_as_lm_evaluation_harness_asks(client, smollm):
    """echo, logprobs and max_tokens 0 or 1, prompts as token ids in a batch: each prompt's
    tokens' logprobs (the first null), equal to the engine's prompt_logprobs."""
    texts = ["The capital of France is Paris.", "Two plus two is four, and three plus three is six."]
    ids = [smollm.encode(t) for t in texts]
    want = smollm.generate(ids, SamplingParams.greedy(max_tokens=1, prompt_logprobs=1))
    for max_tokens in (0, 1):
        r = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=max_tokens,
                                      temperature=0, seed=1234)
        assert [c.index for c in r.choices] == [0, 1]
        for c, w, p in zip(r.choices, want, ids):
            lp = c.logprobs
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            assert lp.token_logprobs[1:len(p)] == [x.logprob for x in w.prompt_logprobs[1:]]
            tops = [max(t.values()) for t in lp.top_logprobs[1:len(p)]]
            assert tops == [x.top[0][1] for x in w.prompt_logprobs[1:]]
            assert len(lp.tokens) == len(p) + max_tokens and c.text.startswith(smollm.tokenizer.decode(p))
            assert c.finish_reason == "length" or max_tokens  # (one token may be the end of text)
        assert r.usage.prompt_tokens == sum(map(len, ids)) and r.usage.completion_tokens == 2 * max_tokens
    one = client.completions.create(model=MODEL, prompt=texts[0], echo=True, max_tokens=3, temperature=0)
    assert one.choices[0].text.startswith(texts[0]) and one.choices[0].logprobs is None
    # Streamed: the prompt (and its logprobs) first, then the answer, as one whole answer would have it.
    for max_tokens in (0, 3):
        whole = client.completions.create(model=MODEL, prompt=texts[1], echo=True, logprobs=1, max_tokens=max_tokens,
                                          temperature=0).choices[0]
        parts = list(client.completions.create(model=MODEL, prompt=texts[1], echo=True, logprobs=1,
                                               max_tokens=max_tokens, temperature=0, stream=True))
        assert "".join(p.choices[0].text for p in parts) == whole.text and parts[0].choices[0].text == texts[1]
        streamed = [x for p in parts if p.choices[0].logprobs for x in p.choices[0].logprobs.token_logprobs]
        offsets = [x for p in parts if p.choices[0].logprobs for x in p.choices[0].logprobs.text_offset]
        assert streamed == whole.logprobs.token_logprobs and offsets == whole.logprobs.text_offset
        assert parts[-1].choices[0].finish_reason == whole.finish_reason
    for bad, says in ((dict(prompt=ids[0], max_tokens=0), "max_tokens"),
                      (dict(prompt=[[1, 2], "text", 3], max_tokens=1), "prompt"),
                      (dict(prompt=[10**9], max_tokens=1), "vocabulary")):
        with pytest.raises(openai.BadRequestError, match=says):
            client.completions.create(model=MODEL, **bad)
