"""Tool calling: the tools are rendered by the model's own chat template, the model's calls
are parsed out of its output, and `tool_choice` "required" or a named function becomes a
grammar over the model's call format and the functions' parameter schemas, so that the
arguments always parse and validate.

The call format is the one Qwen2.5, Qwen3 and Hermes-style templates ask for:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

where `<tool_call>` and `</tool_call>` are special tokens in Qwen's vocabulary (the grammar
names them as tokens then) or plain text in others. A template that mentions neither `tools`
nor `<tool_call>` has no tool support: such a model answers tools with a clear error.
"""
import json
import logging
import re
import uuid
from dataclasses import dataclass

from ssd.errors import SSDError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CHOICES = ("none", "auto", "required")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
log = logging.getLogger("ssd")


class ToolError(SSDError):
    """Tools, a tool choice or tool messages that cannot be used, or a model without tool support."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI carries it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or "call_" + uuid.uuid4().hex[:24]


@dataclass
class Tools:
    """A request's tools (OpenAI's function definitions, checked), its tool_choice ("none",
    "auto", "required", or a function's name) and whether several calls may come at once."""

    definitions: list[dict]
    choice: str = "auto"
    parallel: bool = True

    @classmethod
    def check(cls, tools, choice="auto", parallel=True) -> "Tools":
        if not isinstance(tools, list) or not tools:
            raise ToolError("'tools' must be a non-empty list of {'type': 'function', 'function': {...}}", "tools")
        names = []
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
                raise ToolError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                                "'parameters': {...}}}}", f"tools[{i}]")
            name = fn.get("name")
            if not isinstance(name, str) or not _NAME.fullmatch(name):
                raise ToolError(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -, got {name!r}",
                                f"tools[{i}].function.name")
            if name in names:
                raise ToolError(f"tools[{i}]: the function name {name!r} is used twice", f"tools[{i}].function.name")
            if not isinstance(fn.get("parameters", {}), dict):
                raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object",
                                f"tools[{i}].function.parameters")
            names.append(name)
        if isinstance(choice, dict):
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if choice.get("type") != "function" or not isinstance(name, str):
                raise ToolError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                                "'function': {'name': ...}}", "tool_choice")
            if name not in names:
                raise ToolError(f"tool_choice names the function {name!r}, which is not among the tools "
                                f"({', '.join(names)})", "tool_choice")
            choice = name
        elif choice not in CHOICES:
            raise ToolError(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                            "tool_choice")
        if not isinstance(parallel, bool):
            raise ToolError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
        return cls([{"type": "function", "function": t["function"]} for t in tools], choice, parallel)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.definitions)

    @property
    def calls_parsed(self) -> bool:
        """Whether the output is read for calls ("none": the model answers in text)."""
        return self.choice != "none"


class ToolFormat:
    """A model's way of writing calls, found from its tokenizer and chat template."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # Added tokens (Qwen's <tool_call> is one, though not marked special) are tokens of
        # their own to llguidance: the grammar names them as tokens, not as text.
        added = {t.content for t in tokenizer.added_tokens_decoder.values()}
        self.special = OPEN in added and CLOSE in added

    @staticmethod
    def supported(tokenizer) -> bool:
        template = tokenizer.chat_template or ""
        return "tools" in template and OPEN in template

    def grammar(self, tools: Tools) -> str | None:
        """A Lark grammar (llguidance's dialect) that admits only valid calls, for "required"
        or a named function; None for "auto" and "none". The calls may take any form the parser
        reads as calls, so the model writes the one it would have written: call blocks (the
        chat template's; several where parallel calls are allowed), or one call as JSON in a
        ```json fence or bare (what Qwen2.5-Coder writes unconstrained), after which the
        grammar ends. Forced into blocks, that model took the separator before another block
        over its end token after every call, and repeated one call until max_tokens."""
        if tools.choice in ("auto", "none"):
            return None
        chosen = [t["function"] for t in tools.definitions if tools.choice in ("required", t["function"]["name"])]
        body = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                           "properties": {"name": {"const": f["name"]},
                                          "arguments": f.get("parameters") or {"type": "object"}}}
                          for f in chosen]}
        tag = (lambda t: t) if self.special else json.dumps  # a special token is named bare in Lark
        calls = 'call ("\\n" call)*' if tools.parallel and tools.choice == "required" else "call"
        return (f"start: {calls} | fence | body\n"
                f'call: {tag(OPEN)} "\\n" body "\\n" {tag(CLOSE)}\n'
                'fence: "```" "json"? "\\n" body "\\n```"\n'
                f"body: %json {json.dumps(body)}\n")

    def text(self, ids: list[int]) -> str:
        """The output's text with the call markers kept (they may be special tokens)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    @staticmethod
    def parse(text: str, end_texts: tuple[str, ...] = (), names: tuple[str, ...] = (), parallel: bool = True
              ) -> tuple[str, list[ToolCall]]:
        """The content before the first call and the calls. A call whose JSON does not parse,
        or has no name, leaves the whole output as content (no calls), as other servers do;
        only a last call cut short (by max_tokens) is dropped while the calls before it stand.
        names: the request's functions; an output that is nothing but calls {"name": one of
        them, "arguments": {...}} as JSON (bare or in a ```json fence, as Qwen2.5-Coder often
        answers: one object, several one after another, or a list of them) is those calls too.
        parallel False (parallel_tool_calls): the first call only, where no grammar bounded the
        output to one (tool_choice "auto"), and a warning in the log."""
        content, calls = ToolFormat._calls(text, end_texts, names)
        if not parallel and len(calls) > 1:
            log.warning("parallel_tool_calls is false and the model called %d tools: the first is kept", len(calls))
            calls = calls[:1]
        return content, calls

    @staticmethod
    def _calls(text: str, end_texts: tuple[str, ...], names: tuple[str, ...]) -> tuple[str, list[ToolCall]]:
        for end in end_texts:
            text = text.removesuffix(end)
        start = text.find(OPEN)
        if start < 0:
            bare = _bare_calls(text, names)
            return ("", bare) if bare else (text, [])
        calls = []
        pattern = re.escape(OPEN) + r"(.*?)(" + re.escape(CLOSE) + r"|$)"
        for block, closed in re.findall(pattern, text[start:], re.S):
            try:
                call = json.loads(_single_braces(block))
                name, arguments = call["name"], call.get("arguments", {})
                if not isinstance(name, str):
                    raise TypeError
            except (json.JSONDecodeError, KeyError, TypeError):
                if closed or not calls:
                    return text, []
                break
            calls.append(ToolCall(name, arguments if isinstance(arguments, str) else json.dumps(arguments)))
        return text[:start].rstrip(), calls


def _bare_calls(text: str, names: tuple[str, ...]) -> list[ToolCall]:
    """The calls of an output that is only calls as JSON (ToolFormat.parse); [] where any part
    of it is not a call of the request's functions."""
    body = re.fullmatch(r"\s*(?:```(?:json)?\s*)?([\[{].*[\]}])\s*(?:```)?\s*", text, re.S)
    if not names or body is None:
        return []
    found, rest, decoder = [], _single_braces(body.group(1)), json.JSONDecoder()
    try:
        while rest:
            value, end = decoder.raw_decode(rest)
            found += value if isinstance(value, list) else [value]
            rest = rest[end:].lstrip()
    except json.JSONDecodeError:
        return []
    if not all(isinstance(c, dict) and set(c) == {"name", "arguments"} and c["name"] in names
               and isinstance(c["arguments"], dict) for c in found):
        return []
    return [ToolCall(c["name"], json.dumps(c["arguments"])) for c in found]


def _single_braces(text: str) -> str:
    """A call written in doubled braces, {{"name": ..., "arguments": {...}}}, as one: Qwen2.5's
    chat template shows the call format that way (a format string's escape left in), and its
    models copy it now and then."""
    inner = text.strip()
    return inner[1:-1] if inner.startswith("{{") and inner.endswith("}}") else text


def _may_be_bare_call(text: str) -> bool:
    """Whether streamed text could still turn out to be bare calls (held back until the end)."""
    head = text.lstrip()
    if head.startswith("["):  # a list, while it may still be one of objects
        return head[1:].lstrip()[:1] in ("", "{")
    return head.startswith(("{", "```")) or "```".startswith(head)


def finish_reason(reason: str | None, calls: list[ToolCall] | None) -> str | None:
    """How a request finished, as the APIs say it: one that stopped by its own end after
    calling tools finished with "tool_calls" (OpenAI's reason; Anthropic's "tool_use")."""
    return "tool_calls" if calls and reason == "stop" else reason


class CallStream:
    """A tool request's output as it streams: content is handed out until a call begins
    (text that could be the start of one is held back); the calls come at the end."""

    def __init__(self, fmt: ToolFormat, end_texts: tuple[str, ...], names: tuple[str, ...] = (),
                 parallel: bool = True):
        self.fmt, self.end_texts, self.names, self.parallel = fmt, end_texts, names, parallel
        self.ids: list[int] = []
        self.sent = 0  # characters of content handed out
        self.in_call = False

    def _text(self) -> str:
        text = self.fmt.text(self.ids)
        for end in self.end_texts:
            text = text.removesuffix(end)
        return text

    def push(self, ids: list[int]) -> str:
        """New content after these tokens ("" once a call has begun)."""
        self.ids += ids
        if self.in_call:
            return ""
        text = self._text()
        start = text.find(OPEN)
        self.in_call = start >= 0
        if self.in_call:
            upto = start
        elif self.names and _may_be_bare_call(text):
            upto = 0
        else:
            upto = len(text) - next((k for k in range(len(OPEN) - 1, 0, -1) if text.endswith(OPEN[:k])), 0)
            upto -= text[:upto].endswith("\ufffd")  # a character still incomplete
        piece = text[self.sent:max(upto, self.sent)]
        self.sent += len(piece)
        return piece

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content not handed out yet, and the calls."""
        content, calls = self.fmt.parse(self._text(), names=self.names, parallel=self.parallel)
        return content[self.sent:], calls

    def step(self, ids: list[int], last: bool) -> tuple[str, list[ToolCall]]:
        """New content after these tokens, and with the request's last tokens its calls."""
        text = self.push(ids)
        if not last:
            return text, []
        rest, calls = self.finish()
        return text + rest, calls


def template_messages(chat: list[dict]) -> list[dict]:
    """Messages as chat templates read them: a tool call's arguments as an object (OpenAI
    carries JSON text; templates write `arguments | tojson`)."""
    out = []
    for m in chat:
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c["function"])
                if isinstance(fn.get("arguments"), str):
                    fn["arguments"] = json.loads(fn["arguments"])
                calls.append({**c, "function": fn})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out
