"""OpenAI's request and response shapes: a request body checked into (prompt, SamplingParams),
and the JSON the server answers with.

Every field of a request is either used, accepted because it cannot change the result
(`user`, `metadata`, ...), accepted only at its neutral value (`best_of: 1`, chat's `echo:
false`, ...), or refused with a 400 that names it. None is ignored silently. Completions take
`echo`, and with it `max_tokens: 0` and `logprobs`: the prompt scored, as lm-evaluation-harness
asks. Extensions, as vLLM and llama-server name them: top_k, min_p, min_tokens,
repetition_penalty, ignore_eos, a constraint as `json_schema` (a schema), `regex` or `grammar`
(Lark or GBNF) beside OpenAI's `response_format`, and vLLM's `cache_salt` (the request's
tenant for the prefix cache).
"""
import json
import time
import uuid
from dataclasses import asdict, dataclass

from ssd.errors import ContextLengthError, GrammarError, SamplingParamsError, SSDError
from ssd.outputs import RequestMetrics, StreamChunk, TokenLogprob
from ssd.sampling_params import SamplingParams
from ssd.tools import ToolCall, ToolError, Tools


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def api_error(e: SSDError, constraint_field: str | None = None) -> APIError:
    """A user's mistake found by the engine, as a 400 naming the field (constraint_field: the
    field that carried the request's constraint)."""
    if isinstance(e, ContextLengthError):
        return APIError(400, str(e), param="max_tokens", code="context_length_exceeded")
    if isinstance(e, ToolError):
        return APIError(400, str(e), param=e.param)
    if isinstance(e, GrammarError):
        return APIError(400, str(e), param=constraint_field)
    if isinstance(e, SamplingParamsError):
        return APIError(400, str(e), param=_param(str(e)))
    return APIError(400, str(e))


# Fields used by both routes.
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "seed", "stream", "stream_options",
          "ignore_eos", "n", "user", "metadata", "store", "service_tier", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logit_bias", "min_tokens", "logprobs", "response_format", "json_schema", "regex",
          "grammar", "cache_salt", "speculate"}
CHAT = COMMON | {"messages", "max_completion_tokens", "parallel_tool_calls", "top_logprobs", "tools", "tool_choice"}
COMPLETION = COMMON | {"prompt"}
# Accepted only at the value that leaves the output as it is.
NEUTRAL = {"echo": (False,), "best_of": (1,), "suffix": ("",), "functions": ([],), "function_call": ("none", "auto")}
MAX_N = 16  # choices per prompt
MAX_CHOICES = 256  # choices per request (completions: prompts x n)


@dataclass
class ParsedRequest:
    prompt: str | list[dict]
    params: SamplingParams
    stream: bool
    include_usage: bool
    fill_context: bool  # max_tokens is what the context leaves (a chat request without max_tokens)
    n: int = 1  # choices, each its own sequence (choice i of a seeded request uses seed + i)
    logprobs: bool = False  # whether the answer carries logprobs (params.logprobs: how many alternatives)
    constraint_field: str | None = None  # the field that carried a constraint, for errors found later
    tools: Tools | None = None
    batch: list | None = None  # completions: the prompts of a list of them (each with its n choices)
    echo: bool = False  # completions: the prompt's text (and its logprobs) before the answer's
    score_only: bool = False  # completions: max_tokens 0 with echo, the prompt scored and nothing generated
    # stream_options.include_speculation: each engine step's chunk carries `ssd_speculation` (speculation_json)
    include_speculation: bool = False

    @property
    def prompts(self) -> list:
        return self.batch if self.batch is not None else [self.prompt]


def _get(body: dict, name: str, kinds: tuple, default=None):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise APIError(400, f"'{name}' must be {names}, got {value!r}", param=name)
    return value


def _check_fields(body: dict, allowed: set[str]) -> None:
    for name, value in body.items():
        if name in allowed and name not in NEUTRAL:
            continue
        if name in NEUTRAL and (value is None or value in NEUTRAL[name]):
            continue
        if name in NEUTRAL or name in allowed:
            shown = f"'{name}': {json.dumps(value)}"
            raise APIError(400, f"{shown} is not supported by this server (it would change the result); "
                                f"leave it out" + (" or use n=1" if name == "n" else ""), param=name)
        raise APIError(400, f"unsupported parameter '{name}'", param=name)


def joined_text(where: str, content, kinds: set[str], keys: set[str] | None = None) -> str:
    """A string, or a list of text parts (their `type` among `kinds`; with `keys`, no other
    field), as one string; anything else a 400 naming where (the Responses and Messages APIs)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text parts", param=where)
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in kinds or not isinstance(part.get("text"), str) \
                or (keys is not None and set(part) - keys):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"{where}[{j}]: content of type {kind!r} is not supported here (text only)",
                           param=f"{where}[{j}]")
        parts.append(part["text"])
    return "".join(parts)


def _content(i: int, message: dict) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text ones
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(400, f"messages[{i}]: content parts of type {kind!r} are not supported "
                                    "(text only)", param=f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise APIError(400, f"messages[{i}] needs a 'content' string", param=f"messages[{i}].content")


def parse_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
    chat = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise APIError(400, f"messages[{i}] has role {m.get('role')!r}; supported: system, developer, user, "
                                "assistant, tool", param=f"messages[{i}].role")
        allowed = {"role", "content", "name"} | ({"tool_calls"} if role == "assistant" else set()) \
            | ({"tool_call_id"} if role == "tool" else set())
        for name in m:
            if name not in allowed:
                raise APIError(400, f"messages[{i}].{name} is not supported", param=f"messages[{i}].{name}")
        message = {"role": role}
        calls = m.get("tool_calls")
        if calls:
            message["tool_calls"] = _calls(i, calls)
            message["content"] = None if m.get("content") is None else _content(i, m)
        else:
            message["content"] = _content(i, m)
        if role == "tool" and m.get("tool_call_id") is not None:
            message["tool_call_id"] = m["tool_call_id"]
        chat.append(message)
    return chat


def _calls(i: int, calls) -> list[dict]:
    """An assistant message's tool_calls, checked: [{id, type, function: {name, arguments}}]."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise APIError(400, f"{where} must be a list", param=where)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise APIError(400, f"{where}[{j}] must be {{'id', 'type': 'function', 'function': {{'name', "
                                "'arguments': JSON text}}}}", param=f"{where}[{j}]")
        try:
            if not isinstance(json.loads(fn["arguments"]), dict):
                raise ValueError
        except ValueError:
            raise APIError(400, f"{where}[{j}].function.arguments must be a JSON object, got {fn['arguments']!r}",
                           param=f"{where}[{j}].function.arguments") from None
        out.append({"id": c.get("id", ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return out


def parse_request(body, chat: bool, served: set[str], default_max_tokens: int) -> ParsedRequest:
    """A request body of /v1/chat/completions (chat=True) or /v1/completions, checked."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    echo = False if chat else _get(body, "echo", (bool,), False)
    _check_fields({k: v for k, v in body.items() if chat or k != "echo"}, CHAT if chat else COMPLETION)
    model = body.get("model")
    if model is not None and model not in served:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {sorted(served)[0]!r}",
                       param="model", code="model_not_found")
    batch = None
    if chat:
        prompt = parse_messages(body.get("messages"))
    else:
        batch = _prompts(body.get("prompt"))
        prompt, batch = batch[0], batch if len(batch) > 1 else None
    max_tokens = _get(body, "max_completion_tokens", (int,)) if chat else None
    max_tokens = max_tokens if max_tokens is not None else _get(body, "max_tokens", (int,))
    stream = _get(body, "stream", (bool,), False)
    score_only = echo and max_tokens == 0
    if score_only:  # (one token is drawn and dropped: the engine generates at least one)
        max_tokens = 1
    options = _get(body, "stream_options", (dict,), {})
    unknown = set(options) - {"include_usage", "include_speculation"}
    if unknown:
        raise APIError(400, f"unsupported stream_options: {', '.join(sorted(unknown))}", param="stream_options")
    include_usage, include_speculation = options.get("include_usage", False), options.get("include_speculation", False)
    for name, value in (("include_usage", include_usage), ("include_speculation", include_speculation)):
        if not isinstance(value, bool):
            raise APIError(400, f"stream_options.{name} must be a boolean", param="stream_options")
    n = _get(body, "n", (int,), 1)
    if not 1 <= n <= MAX_N:
        raise APIError(400, f"'n' must be in 1..{MAX_N}, got {n}", param="n")
    if n * len(batch or [prompt]) > MAX_CHOICES:
        raise APIError(400, f"{len(batch)} prompts of {n} choices each: at most {MAX_CHOICES} choices a request",
                       param="prompt")
    logprobs, top = _logprobs(body, chat)
    number = (int, float)
    try:
        params = SamplingParams(
            temperature=_get(body, "temperature", number, 1.0), top_p=_get(body, "top_p", number, 1.0),
            top_k=_get(body, "top_k", (int,), 0), min_p=_get(body, "min_p", number, 0.0),
            stop=_get(body, "stop", (str, list)), seed=_get(body, "seed", (int,)),
            ignore_eos=_get(body, "ignore_eos", (bool,), False),
            max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
            min_tokens=_get(body, "min_tokens", (int,), 0),
            presence_penalty=_get(body, "presence_penalty", number, 0.0),
            frequency_penalty=_get(body, "frequency_penalty", number, 0.0),
            repetition_penalty=_get(body, "repetition_penalty", number, 1.0),
            logit_bias=_get(body, "logit_bias", (dict,)), logprobs=top if logprobs else None,
            prompt_logprobs=top if logprobs and echo else None,
            cache_salt=_get(body, "cache_salt", (str,)), speculate=_get(body, "speculate", (bool,), True),
            **_constraint(body))
    except SSDError as e:
        raise APIError(400, str(e), param=_param(str(e))) from None
    tools = None
    if chat and body.get("tools") is not None:
        try:
            tools = Tools.check(body["tools"], body.get("tool_choice") or "auto",
                                _get(body, "parallel_tool_calls", (bool,), True))
        except ToolError as e:
            raise APIError(400, str(e), param=e.param) from None
    elif body.get("tool_choice") not in (None, "none"):
        raise APIError(400, "'tool_choice' needs 'tools'", param="tool_choice")
    field = next((f for f in ("response_format", "json_schema", "regex", "grammar")
                  if body.get(f) is not None and body[f] != {"type": "text"}), None)
    return ParsedRequest(prompt, params, stream, include_usage, chat and max_tokens is None, n, logprobs, field,
                         tools, batch, echo, score_only, include_speculation)


def _prompts(prompt) -> list:
    """Completions' `prompt`: a string, token ids, or a list of either (a batch)."""
    ids = lambda p: isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)  # noqa: E731
                                                      for t in p)
    if isinstance(prompt, str) or ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or ids(p) for p in prompt):
        return prompt
    raise APIError(400, "'prompt' must be a string, a list of token ids, or a non-empty list of either",
                   param="prompt")


def _param(message: str) -> str:
    """The field a SamplingParams message names (its first word, or before a colon)."""
    first = message.split()[0].rstrip(":")
    return {"logprobs": "top_logprobs"}.get(first, first)


def _logprobs(body: dict, chat: bool) -> tuple[bool, int]:
    """(whether to answer with logprobs, how many alternatives): chat's `logprobs` (bool) and
    `top_logprobs` (0..20), completions' `logprobs` (an int, the alternatives)."""
    if chat:
        wanted = _get(body, "logprobs", (bool,), False)
        top = _get(body, "top_logprobs", (int,))
        if top is not None and not wanted:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return wanted, top or 0
    top = _get(body, "logprobs", (int,))
    return top is not None, top or 0


def _constraint(body: dict) -> dict:
    """The request's constraint: OpenAI's response_format, or the extension fields json_schema,
    regex, grammar (at most one, as SamplingParams checks)."""
    out = {name: body[name] for name in ("json_schema", "regex", "grammar") if body.get(name) is not None}
    fmt = _get(body, "response_format", (dict,))
    if fmt is None or fmt.get("type") == "text":
        return out
    if out:
        raise APIError(400, f"'response_format' and '{next(iter(out))}' both constrain the output: send one",
                       param="response_format")
    kind = fmt.get("type")
    if kind == "json_object":
        return {"json_schema": {"type": "object"}}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise APIError(400, "response_format.json_schema must be an object with a 'schema' object",
                           param="response_format")
        # No schema: any JSON value of OpenAI's strict mode, which wants an object at the top.
        return {"json_schema": spec.get("schema") or {"type": "object"}}
    raise APIError(400, f"response_format type {kind!r} is not supported: use 'text', 'json_object' or "
                        "'json_schema'", param="response_format")


# ---- responses ------------------------------------------------------------------------------
def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(metrics: list[RequestMetrics], n: int = 1) -> dict:
    """Token counts of a request's choices, n a prompt: each prompt once (and how much of it came
    from the prefix cache), every choice's output."""
    firsts = metrics[::n]
    prompt, out = sum(m.prompt_tokens for m in firsts), sum(m.output_tokens for m in metrics)
    return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out,
            "prompt_tokens_details": {"cached_tokens": sum(m.cached_tokens for m in firsts)}}


def speculation(m: RequestMetrics, mode: str) -> dict:
    """The extension field `ssd_metrics`: timings and, in SD/SSD, the speculation counters."""
    out = {"mode": mode, "ttft_s": m.ttft_s, "decode_tokens_per_second": m.tokens_per_second}
    if m.rounds:
        out.update(rounds=m.rounds, drafted=m.drafted, accepted=m.accepted, acceptance_rate=m.acceptance_rate,
                   mean_accepted_length=m.mean_accepted_length, mean_k=m.mean_k)
    if m.hits + m.misses:
        out.update(cache_hit_rate=m.cache_hit_rate, hits=m.hits, misses=m.misses)
    return out


def speculation_json(c: StreamChunk) -> dict:
    """The extension field `ssd_speculation` of a streamed chunk (stream_options.include_speculation):
    the chunk's text cut by where its tokens came from (`pieces`, absent for a request with
    tools) and the engine step that made them (`step`: K asked, drafted, accepted, tokens,
    their source, seconds since the request arrived)."""
    out = {"step": asdict(c.step)} if c.step is not None else {}
    if c.pieces is not None:
        out["pieces"] = [{"text": text, "source": source} for text, source in c.pieces]
    return out


@dataclass
class Choice:
    """What one choice of a request got."""

    text: str
    finish_reason: str
    metrics: RequestMetrics
    logprobs: list[TokenLogprob] | None = None
    tool_calls: list[ToolCall] | None = None


def tool_calls_json(calls: list[ToolCall], delta: bool = False) -> list[dict]:
    """Calls as OpenAI writes them (delta: with each call's index, as a streamed delta has it)."""
    return [{**({"index": k} if delta else {}), "id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for k, c in enumerate(calls)]


def completion(chat: bool, rid: str, model: str, choices: list[Choice], mode: str, tokenizer, n: int = 1) -> dict:
    """The whole answer (n choices a prompt); `ssd_metrics` describes the first choice."""
    out = []
    for i, c in enumerate(choices):
        lps = logprobs_json(chat, tokenizer, c.logprobs)
        message = {"role": "assistant", "content": c.text}
        if c.tool_calls:
            message = {"role": "assistant", "content": c.text or None, "tool_calls": tool_calls_json(c.tool_calls)}
        out.append({"index": i, "message": message, "logprobs": lps, "finish_reason": c.finish_reason} if chat else
                   {"index": i, "text": c.text, "logprobs": lps, "finish_reason": c.finish_reason})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": out, "usage": usage([c.metrics for c in choices], n),
            "ssd_metrics": speculation(choices[0].metrics, mode)}


def chunk(chat: bool, rid: str, model: str, text: str | None, finish: str | None, *, index: int = 0,
          role: bool = False, choices: bool = True, logprobs: dict | None = None,
          calls: list[ToolCall] | None = None) -> dict:
    """One streamed chunk; choices=False: the usage chunk (its fields are added by the caller);
    calls: a delta with tool calls (each whole, with its index)."""
    if chat:
        delta = ({"role": "assistant", "content": ""} if role else {} if text is None else {"content": text})
        if calls:
            delta = {"tool_calls": tool_calls_json(calls, delta=True)}
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice] if choices else []}


def logprobs_json(chat: bool, tokenizer, lps: list[TokenLogprob] | None, offset: int = 0) -> dict | None:
    """Logprobs in OpenAI's shape: chat's {"content": [{token, logprob, bytes, top_logprobs}]},
    completions' {tokens, token_logprobs, top_logprobs, text_offset} (offset: the text before)."""
    if lps is None:
        return None
    text = lambda t: tokenizer.decode([t])  # noqa: E731  a token alone (a partial character shows as U+FFFD)
    if chat:
        entry = lambda t, lp: {"token": text(t), "logprob": lp, "bytes": list(text(t).encode())}  # noqa: E731
        return {"content": [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(t, lp) for t, lp in x.top]}
                            for x in lps]}
    tokens = [text(x.token_id) for x in lps]
    offsets = [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    # (An echoed prompt's first token has no logprob: null, as OpenAI's.)
    return {"tokens": tokens, "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [None if x.top is None else {text(t): lp for t, lp in x.top} for x in lps],
            "text_offset": offsets}
