"""Anthropic's Messages API shapes (POST /v1/messages): a request body checked into the same
ParsedRequest the OpenAI routes make, the message the server answers with, the events of a
streamed answer, and errors as {"type": "error", "error": {"type", "message"}}.

The same rule as the OpenAI routes: every field is used, accepted because it cannot change
the result (`metadata`, `service_tier`, `cache_control`: prefix caching is automatic here),
or refused with a 400 naming it. Today's `anthropic` client no longer names temperature,
top_p and top_k; they are taken from the body as older clients send them (or `extra_body`). Tools come in Anthropic's shape
({name, description, input_schema}; tool_choice auto, any, tool, none) and go to the same
tool machinery (ssd/tools.py); calls come back as `tool_use` content blocks. `cache_salt` (an
extension, as on the OpenAI routes) names the request's tenant for the prefix cache.
"""
import json
import uuid

from ssd.errors import SSDError
from ssd.outputs import RequestMetrics
from ssd.sampling_params import SamplingParams
from ssd.serving.openai_protocol import APIError, ParsedRequest, _get, joined_text
from ssd.tools import ToolCall, ToolError, Tools

FIELDS = {"model", "messages", "max_tokens", "system", "temperature", "top_p", "top_k", "stop_sequences", "stream",
          "metadata", "tools", "tool_choice", "cache_control", "service_tier", "cache_salt"}
COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "cache_control"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def error_body(e: APIError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "invalid_request_error"),
                                       "message": e.message}}


def new_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def _text(where: str, content) -> str:
    """A string, or a list of text blocks, as one string."""
    return joined_text(where, content, {"text"}, {"type", "text", "cache_control"})


def parse_messages(messages) -> list[dict]:
    """Anthropic's turns as the chat the model's template renders: text blocks joined, an
    assistant's tool_use blocks as tool_calls, a user's tool_result blocks as tool messages."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages: must be a non-empty list of {role, content}", param="messages")
    chat = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise APIError(400, f"{where}: role must be 'user' or 'assistant'", param=f"{where}.role")
        extra = set(m) - {"role", "content"}
        if extra:
            raise APIError(400, f"{where}.{sorted(extra)[0]} is not supported", param=f"{where}.{sorted(extra)[0]}")
        content = m.get("content")
        if isinstance(content, str):
            chat.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise APIError(400, f"{where}.content must be a string or a list of content blocks",
                           param=f"{where}.content")
        text, calls = [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}.content[{j}]"
            if kind == "text" and isinstance(block.get("text"), str) and not set(block) - {"type", "text", "cache_control"}:
                text.append(block["text"])
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                    raise APIError(400, f"{at}: a tool_use block needs 'name' and an 'input' object", param=at)
                calls.append({"id": str(block.get("id", "")), "type": "function",
                              "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
            elif kind == "tool_result" and m["role"] == "user":
                extra = set(block) - {"type", "tool_use_id", "content", "is_error", "cache_control"}
                if extra:
                    raise APIError(400, f"{at}.{sorted(extra)[0]} is not supported", param=f"{at}.{sorted(extra)[0]}")
                result = _text(f"{at}.content", block.get("content", ""))
                failed = block.get("is_error", False)
                if not isinstance(failed, bool):
                    raise APIError(400, f"{at}.is_error must be a boolean", param=f"{at}.is_error")
                # Chat templates have no field for a failed call (Qwen's and Hermes' render the
                # content alone), so the model reads it in the content.
                chat.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                             "content": f"Error: {result}" if failed else result})
            else:
                raise APIError(400, f"{at}: content blocks of type {kind!r} are not supported in a {m['role']} "
                                    "turn (text, and tool_use / tool_result)", param=at)
        if calls:
            chat.append({"role": "assistant", "content": "".join(text) or None, "tool_calls": calls})
        elif text or m["role"] == "assistant":
            chat.append({"role": m["role"], "content": "".join(text)})
    return chat


def _tools(body: dict) -> Tools | None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice is not None and choice != {"type": "none"}:
            raise APIError(400, "tool_choice: needs 'tools'", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise APIError(400, "tools: must be a list of {name, description, input_schema}", param="tools")
    definitions = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or set(t) - {"name", "description", "input_schema", "type", "cache_control"} \
                or t.get("type", "custom") != "custom":
            raise APIError(400, f"tools[{i}]: must be {{name, description, input_schema}} (custom tools only)",
                           param=f"tools[{i}]")
        fn = {"name": t.get("name"), "parameters": t.get("input_schema", {"type": "object"})}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        definitions.append({"type": "function", "function": fn})
    choice = choice or {"type": "auto"}
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise APIError(400, "tool_choice: must be {'type': 'auto' | 'any' | 'tool' | 'none'}", param="tool_choice")
    kind = choice["type"]
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or \
        {"type": "function", "function": {"name": choice.get("name")}}
    try:
        return Tools.check(definitions, mapped, not choice.get("disable_parallel_tool_use", False))
    except ToolError as e:
        anthropic = lambda s: s.replace(".function.name", ".name").replace(".function.parameters", ".input_schema")  # noqa: E731
        raise APIError(400, anthropic(str(e)), param=anthropic(e.param)) from None


def _check_fields(body, fields: set[str], served: set[str]) -> None:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise APIError(400, f"{unknown[0]}: this field is not supported by this server", param=unknown[0])
    model = body.get("model")
    if not isinstance(model, str):
        raise APIError(400, "model: a model name is required", param="model")
    if model not in served:
        raise APIError(404, f"model: {model!r} does not exist; this server serves {sorted(served)[0]!r}",
                       param="model")


def parse_count(body, served: set[str]) -> tuple[list[dict], Tools | None]:
    """A /v1/messages/count_tokens body, checked: the chat and the tools whose tokens it counts."""
    _check_fields(body, COUNT_FIELDS, served)
    chat = parse_messages(body.get("messages"))
    if body.get("system") is not None:
        chat.insert(0, {"role": "system", "content": _text("system", body["system"])})
    return chat, _tools(body)


def parse_request(body, served: set[str]) -> ParsedRequest:
    """A /v1/messages body, checked."""
    _check_fields(body, FIELDS, served)
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        raise APIError(400, "max_tokens: a positive integer is required", param="max_tokens")
    chat = parse_messages(body.get("messages"))
    if body.get("system") is not None:
        chat.insert(0, {"role": "system", "content": _text("system", body["system"])})
    number = (int, float)
    stops = _get(body, "stop_sequences", (list,), [])
    if not all(isinstance(s, str) and s for s in stops):
        raise APIError(400, "stop_sequences: must be a list of non-empty strings", param="stop_sequences")
    try:
        params = SamplingParams(temperature=_get(body, "temperature", number, 1.0), top_p=_get(body, "top_p", number, 1.0),
                                top_k=_get(body, "top_k", (int,), 0), stop=stops or None, max_tokens=max_tokens,
                                cache_salt=_get(body, "cache_salt", (str,)))
    except SSDError as e:
        raise APIError(400, str(e), param=str(e).split()[0].rstrip(":")) from None
    _get(body, "metadata", (dict,))
    return ParsedRequest(chat, params, _get(body, "stream", (bool,), False), False, False, tools=_tools(body))


def stop_reason(finish_reason: str, stop_sequence: str | None) -> str:
    if finish_reason == "stop":
        return "stop_sequence" if stop_sequence is not None else "end_turn"
    return STOP_REASONS.get(finish_reason, finish_reason)


def usage(m: RequestMetrics, prompt_tokens: int | None = None) -> dict:
    """Anthropic counts input tokens apart from those read from the cache."""
    prompt = m.prompt_tokens if prompt_tokens is None else prompt_tokens
    return {"input_tokens": prompt - m.cached_tokens, "cache_read_input_tokens": m.cached_tokens,
            "cache_creation_input_tokens": 0, "output_tokens": m.output_tokens}


def tool_use(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": json.loads(call.arguments)}


def message(rid: str, model: str, text: str, calls: list[ToolCall] | None, finish_reason: str,
            stop_sequence: str | None, metrics: RequestMetrics) -> dict:
    content = ([{"type": "text", "text": text}] if text or not calls else []) + [tool_use(c) for c in calls or []]
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason(finish_reason, stop_sequence), "stop_sequence": stop_sequence,
            "usage": usage(metrics)}


def event(kind: str, **fields) -> str:
    """One server-sent event of a streamed message."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"
