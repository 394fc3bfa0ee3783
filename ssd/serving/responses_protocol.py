"""OpenAI's Responses API shapes (POST /v1/responses): a request body checked and turned into
the chat request the chat route would make (the same checks, the same tools and constraints),
the response object, its streamed events, and the responses kept for `previous_response_id`.

The same rule as the other routes: every field is used, accepted because it cannot change
the result (`metadata`, `user`, `service_tier`, `prompt_cache_key`: prefix caching is
automatic here), or refused with a 400 naming it. `instructions` are a system message that a
follow-up by `previous_response_id` does not carry over, as OpenAI says.
"""
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from ssd.outputs import RequestMetrics
from ssd.serving.openai_protocol import APIError, ParsedRequest, _get, joined_text, tool_calls_json
from ssd.serving.openai_protocol import parse_request as parse_chat_request
from ssd.tools import ToolCall

FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
          "temperature", "top_p", "text", "stream", "store", "previous_response_id", "metadata", "user", "include",
          "truncation", "reasoning", "service_tier", "prompt_cache_key", "prompt_cache_retention",
          "safety_identifier", "background", "cache_salt"}
# Accepted only at the value that leaves the output as it is.
NEUTRAL = {"include": (None, []), "truncation": (None, "disabled"), "reasoning": (None, {}),
           "background": (None, False)}
MAX_STORED = 1000  # responses kept for previous_response_id and GET, the oldest evicted first
TEXT_PARTS = {"input_text", "output_text"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


@dataclass
class ResponsesRequest:
    chat: ParsedRequest  # what the engine runs
    conversation: list[dict]  # the chat without the instructions: what a follow-up continues
    echo: dict = field(default_factory=dict)  # the request's settings the response repeats
    items: list[dict] = field(default_factory=list)  # its input as items with ids (GET .../input_items)


def _text(where: str, content) -> str:
    """A string, or a list of input_text / output_text parts, as one string."""
    return joined_text(where, content, TEXT_PARTS)


def parse_input(items) -> list[dict]:
    """`input` as chat messages: a string is a user message; items are messages (roles user,
    system, developer, assistant), function calls (an assistant's tool_calls, consecutive ones
    in one message) and their outputs (tool messages)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError(400, "input: must be a string or a non-empty list of items", param="input")
    chat: list[dict] = []
    for i, item in enumerate(items):
        at = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("user", "system", "developer", "assistant"):
            role = "system" if item["role"] == "developer" else item["role"]
            chat.append({"role": role, "content": _text(f"{at}.content", item.get("content"))})
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(args, str) or not isinstance(call_id, str):
                raise APIError(400, f"{at}: a function_call needs 'call_id', 'name' and 'arguments' (JSON text)",
                               param=at)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = chat[-1] if chat else None
            if last is not None and last["role"] == "assistant":  # (its text, or calls before this one)
                last.setdefault("tool_calls", []).append(call)
                last["content"] = last["content"] or None
            else:
                chat.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"{at}: a function_call_output needs 'call_id'", param=f"{at}.call_id")
            chat.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": _text(f"{at}.output", item.get("output"))})
        else:
            shown = kind if kind != "message" else f"message with role {item.get('role')!r}"
            raise APIError(400, f"{at}: items of type {shown!r} are not supported (messages, function_call, "
                                "function_call_output)", param=at)
    return chat


def input_items(items) -> list[dict]:
    """`input` (checked by parse_input) as the Responses API lists it back: each item with an id
    (its own, or a new one) and a status; a message's text as parts."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    out = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            content = item["content"]
            part = "output_text" if item["role"] == "assistant" else "input_text"
            out.append({"id": item.get("id") or new_id("msg"), "type": "message", "role": item["role"],
                        "content": [{"type": part, "text": content}] if isinstance(content, str) else content,
                        "status": "completed"})
        elif kind == "function_call":
            out.append({"id": item.get("id") or new_id("fc"), "type": "function_call", "call_id": item["call_id"],
                        "name": item["name"], "arguments": item["arguments"], "status": "completed"})
        else:
            out.append({"id": item.get("id") or new_id("fco"), "type": "function_call_output",
                        "call_id": item["call_id"], "output": item.get("output"), "status": "completed"})
    return out


def item_page(items: list[dict], query) -> dict:
    """GET /v1/responses/{id}/input_items: a page of `items` by the query's `order` ("desc", the
    default, newest first; or "asc"), `after` (an item id) and `limit` (1 to 100, default 20)."""
    unknown = sorted(set(query) - {"order", "after", "limit", "include"})
    if unknown:
        raise APIError(400, f"unsupported parameter '{unknown[0]}'", param=unknown[0])
    if query.get("include"):
        raise APIError(400, "include: no additional fields are kept here", param="include")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order: must be 'asc' or 'desc', got {order!r}", param="order")
    limit = query.get("limit", "20")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise APIError(400, f"limit: must be an integer from 1 to 100, got {limit!r}", param="limit")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if query.get("after") is not None:
        ids = [i["id"] for i in ordered]
        if query["after"] not in ids:
            raise APIError(400, f"after: no input item with id {query['after']!r} in this response", param="after")
        start = ids.index(query["after"]) + 1
    page = ordered[start:start + int(limit)]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + len(page) < len(ordered)}


def _tools(body: dict) -> tuple[list[dict] | None, object]:
    """Function tools and tool_choice in the chat route's shape."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None and not isinstance(tools, list):
        raise APIError(400, "tools: must be a list of function tools", param="tools")
    chat_tools = []
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise APIError(400, f"tools[{i}]: tools of type {kind!r} are not supported (function tools only)",
                           param=f"tools[{i}]")
        unknown = sorted(set(t) - {"type", "name", "description", "parameters", "strict"})
        if unknown:
            raise APIError(400, f"tools[{i}].{unknown[0]} is not supported", param=f"tools[{i}].{unknown[0]}")
        chat_tools.append({"type": "function", "function": {k: t[k] for k in t if k != "type" and t[k] is not None}})
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice: must be 'none', 'auto', 'required' or {'type': 'function', "
                                "'name': ...}", param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return chat_tools or None, choice


def _format(body: dict) -> dict | None:
    """`text.format` as the chat route's response_format."""
    text = _get(body, "text", (dict,), {})
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown or text.get("verbosity") is not None:
        name = unknown[0] if unknown else "verbosity"
        raise APIError(400, f"text.{name} is not supported by this server", param=f"text.{name}")
    fmt = text.get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_object", "json_schema"):
        raise APIError(400, "text.format: must be {'type': 'text' | 'json_object' | 'json_schema', ...}",
                       param="text.format")
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    if not isinstance(fmt.get("schema", {}), dict):
        raise APIError(400, "text.format.schema must be a JSON schema object", param="text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"), "schema": fmt.get("schema")}}


def parse_request(body, served: set[str], store: "ResponseStore") -> ResponsesRequest:
    """A /v1/responses body, checked, as the chat request it asks for."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for name, value in body.items():
        if name not in FIELDS:
            raise APIError(400, f"unsupported parameter '{name}'", param=name)
        if name in NEUTRAL and value not in NEUTRAL[name]:
            raise APIError(400, f"'{name}' is not supported by this server at {value!r} (it would change the "
                                "result); leave it out", param=name)
    previous = _get(body, "previous_response_id", (str,))
    history = store.conversation(previous) if previous is not None else []
    conversation = history + parse_input(body.get("input"))
    instructions = _get(body, "instructions", (str,))
    chat = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    max_output = _get(body, "max_output_tokens", (int,))
    if max_output is not None and max_output < 1:
        raise APIError(400, f"max_output_tokens: must be at least 1, got {max_output}", param="max_output_tokens")
    tools, choice = _tools(body)
    chat_body = {"model": body.get("model"), "messages": chat, "max_completion_tokens": max_output,
                 "temperature": body.get("temperature"), "top_p": body.get("top_p"), "tools": tools,
                 "tool_choice": choice, "parallel_tool_calls": body.get("parallel_tool_calls"),
                 "response_format": _format(body), "stream": body.get("stream"), "cache_salt": body.get("cache_salt")}
    try:
        parsed = _chat(chat_body, served)
    except APIError as e:
        raise renamed(e) from None
    metadata = _get(body, "metadata", (dict,), {})
    echo = {"instructions": instructions, "max_output_tokens": max_output, "metadata": metadata,
            "parallel_tool_calls": _get(body, "parallel_tool_calls", (bool,), True), "previous_response_id": previous,
            "store": _get(body, "store", (bool,), True), "temperature": parsed.params.temperature,
            "top_p": parsed.params.top_p, "text": {"format": _get(body, "text", (dict,), {}).get("format")
                                                   or {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "user": _get(body, "user", (str,)), "truncation": "disabled",
            "service_tier": _get(body, "service_tier", (str,), "default")}
    return ResponsesRequest(parsed, conversation, echo, input_items(body["input"]))


def renamed(e: APIError) -> APIError:
    """An error of the chat route's checks with the fields named as this API names them."""
    names = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
             "response_format": "text.format"}
    message = e.message.replace("max_completion_tokens", "max_output_tokens").replace("max_tokens",
                                                                                       "max_output_tokens")
    return APIError(e.status, message, param=names.get(e.param, e.param), type=e.type, code=e.code)


def _chat(chat_body: dict, served: set[str]) -> ParsedRequest:
    """The chat route's checks (without max_output_tokens, the answer may fill the context)."""
    return parse_chat_request({k: v for k, v in chat_body.items() if v is not None}, True, served,
                              default_max_tokens=16)


# ---- the response ---------------------------------------------------------------------------
def usage(m: RequestMetrics) -> dict:
    return {"input_tokens": m.prompt_tokens, "input_tokens_details": {"cached_tokens": m.cached_tokens},
            "output_tokens": m.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": m.prompt_tokens + m.output_tokens}


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    done = status == "completed"
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if done else []
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status == "completed" else ""}


def output_items(text: str, calls: list[ToolCall] | None) -> list[dict]:
    """The answer as output items: its text as a message (where there is text, or no call),
    then a function_call item per call."""
    items = [message_item(new_id("msg"), text)] if text or not calls else []
    return items + [call_item(new_id("fc"), c) for c in calls or []]


def response(rid: str, created: float, model: str, req: ResponsesRequest, output: list[dict],
             finish_reason: str | None, metrics: RequestMetrics | None, extra: dict | None = None) -> dict:
    """The response object; finish_reason None: still in progress."""
    status = "in_progress" if finish_reason is None else "incomplete" if finish_reason == "length" else "completed"
    return {"id": rid, "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": model, "output": output, "reasoning": {"effort": None, "summary": None},
            "usage": usage(metrics) if metrics is not None and finish_reason is not None else None,
            **req.echo, **(extra or {})}


def failed(body: dict, message: str) -> dict:
    return {**body, "status": "failed", "error": {"code": "server_error", "message": message}}


class Events:
    """A streamed response's server-sent events, numbered in order (sequence_number)."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"


# ---- kept responses -------------------------------------------------------------------------
class ResponseStore:
    """Responses kept for GET /v1/responses/{id} and previous_response_id, with the conversation
    each ended (its input's and its output's turns), MAX_STORED at most, the oldest evicted
    first. In memory: a restart forgets them."""

    def __init__(self, most: int = MAX_STORED):
        self.most = most
        self.kept: OrderedDict[str, tuple[dict, list[dict], list[dict]]] = OrderedDict()

    def keep(self, body: dict, conversation: list[dict], text: str, calls: list[ToolCall] | None,
             items: list[dict] = ()) -> None:
        """A response, the conversation it continued and its input items."""
        turn = {"role": "assistant", "content": text or None}
        if calls:
            turn["tool_calls"] = tool_calls_json(calls)
        self.kept[body["id"]] = body, conversation + [turn], list(items)
        while len(self.kept) > self.most:
            self.kept.popitem(last=False)

    def get(self, rid: str) -> dict:
        if rid not in self.kept:
            raise APIError(404, f"no response with id {rid!r} is kept here (responses are kept in memory, the "
                                f"last {self.most}, and only with store: true)", param="response_id",
                           code="not_found")
        return self.kept[rid][0]

    def input_items(self, rid: str) -> list[dict]:
        self.get(rid)
        return self.kept[rid][2]

    def conversation(self, rid: str) -> list[dict]:
        if rid not in self.kept:
            raise APIError(404, f"previous_response_id: no response with id {rid!r} is kept here (the last "
                                f"{self.most}, and only with store: true)", param="previous_response_id",
                           code="not_found")
        return [dict(m) for m in self.kept[rid][1]]

    def delete(self, rid: str) -> None:
        self.get(rid)
        del self.kept[rid]


def now() -> float:
    return float(int(time.time()))
