"""OpenAI's request and response shapes: a request body checked into (prompt, SamplingParams),
and the JSON the server answers with.

Every field of a request is either used, accepted because it cannot change the result
(`user`, `metadata`, ...), accepted only at its neutral value (`n: 1`, `logprobs: false`,
`presence_penalty: 0`, ...), or refused with a 400 that names it. None is ignored silently.
"""
import json
import time
import uuid
from dataclasses import dataclass

from ssd.errors import ContextLengthError, SSDError
from ssd.outputs import RequestMetrics
from ssd.sampling_params import SamplingParams


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def api_error(e: SSDError) -> APIError:
    """A user's mistake found by the engine, as a 400."""
    if isinstance(e, ContextLengthError):
        return APIError(400, str(e), param="max_tokens", code="context_length_exceeded")
    return APIError(400, str(e))


# Fields used by both routes; top_k and ignore_eos are extensions (vLLM has them too).
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream", "stream_options",
          "ignore_eos", "n", "user", "metadata", "store", "service_tier"}
CHAT = COMMON | {"messages", "max_completion_tokens", "parallel_tool_calls"}
COMPLETION = COMMON | {"prompt"}
# Accepted only at the value that leaves the output as it is.
NEUTRAL = {"n": (1,), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
           "logprobs": (False, 0), "top_logprobs": (0,), "logit_bias": ({},), "tools": ([],),
           "tool_choice": ("none", "auto"), "response_format": ({"type": "text"},), "echo": (False,),
           "best_of": (1,), "suffix": ("",), "functions": ([],), "function_call": ("none", "auto"),
           "min_tokens": (0,)}


@dataclass
class ParsedRequest:
    prompt: str | list[dict]
    params: SamplingParams
    stream: bool
    include_usage: bool
    fill_context: bool  # max_tokens is what the context leaves (a chat request without max_tokens)


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
        if role not in ("system", "user", "assistant"):
            raise APIError(400, f"messages[{i}] has role {m.get('role')!r}; supported: system, developer, user, "
                                "assistant", param=f"messages[{i}].role")
        for name in m:
            if name not in ("role", "content", "name"):
                raise APIError(400, f"messages[{i}].{name} is not supported", param=f"messages[{i}].{name}")
        chat.append({"role": role, "content": _content(i, m)})
    return chat


def parse_request(body, chat: bool, served: set[str], default_max_tokens: int) -> ParsedRequest:
    """A request body of /v1/chat/completions (chat=True) or /v1/completions, checked."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    _check_fields(body, CHAT if chat else COMPLETION)
    model = body.get("model")
    if model is not None and model not in served:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {sorted(served)[0]!r}",
                       param="model", code="model_not_found")
    if chat:
        prompt = parse_messages(body.get("messages"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise APIError(400, "'prompt' must be one string (lists of prompts and token ids are not supported)",
                           param="prompt")
    max_tokens = _get(body, "max_completion_tokens", (int,)) if chat else None
    max_tokens = max_tokens if max_tokens is not None else _get(body, "max_tokens", (int,))
    stream = _get(body, "stream", (bool,), False)
    options = _get(body, "stream_options", (dict,), {})
    unknown = set(options) - {"include_usage"}
    if unknown:
        raise APIError(400, f"unsupported stream_options: {', '.join(sorted(unknown))}", param="stream_options")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise APIError(400, "stream_options.include_usage must be a boolean", param="stream_options")
    try:
        params = SamplingParams(
            temperature=_get(body, "temperature", (int, float), 1.0), top_p=_get(body, "top_p", (int, float), 1.0),
            top_k=_get(body, "top_k", (int,), 0), stop=_get(body, "stop", (str, list)),
            seed=_get(body, "seed", (int,)), ignore_eos=_get(body, "ignore_eos", (bool,), False),
            max_tokens=max_tokens if max_tokens is not None else default_max_tokens)
    except SSDError as e:
        raise APIError(400, str(e), param=str(e).split()[0]) from None
    return ParsedRequest(prompt, params, stream, include_usage, chat and max_tokens is None)


# ---- responses ------------------------------------------------------------------------------
def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(m: RequestMetrics) -> dict:
    return {"prompt_tokens": m.prompt_tokens, "completion_tokens": m.output_tokens,
            "total_tokens": m.prompt_tokens + m.output_tokens}


def speculation(m: RequestMetrics, mode: str) -> dict:
    """The extension field `ssd_metrics`: timings and, in SD/SSD, the speculation counters."""
    out = {"mode": mode, "ttft_s": m.ttft_s, "decode_tokens_per_second": m.tokens_per_second}
    if m.rounds:
        out.update(rounds=m.rounds, drafted=m.drafted, accepted=m.accepted, acceptance_rate=m.acceptance_rate,
                   mean_accepted_length=m.mean_accepted_length, mean_k=m.mean_k)
    if m.hits + m.misses:
        out.update(cache_hit_rate=m.cache_hit_rate, hits=m.hits, misses=m.misses)
    return out


def completion(chat: bool, rid: str, model: str, text: str, finish: str, m: RequestMetrics, mode: str) -> dict:
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
               "finish_reason": finish} if chat else
              {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage(m), "ssd_metrics": speculation(m, mode)}


def chunk(chat: bool, rid: str, model: str, text: str | None, finish: str | None, *, role: bool = False,
          choices: bool = True) -> dict:
    """One streamed chunk; choices=False: the usage chunk (its fields are added by the caller)."""
    if chat:
        delta = ({"role": "assistant", "content": ""} if role else {} if text is None else {"content": text})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice] if choices else []}
