import math
from dataclasses import dataclass

from ssd.checks import check_int, is_int, is_number
from ssd.errors import SamplingParamsError

MAX_SEED = 2**64  # torch generators take 64-bit seeds


def _list(value, kind: type, name: str, allowed: str) -> list:
    """None, one item or a list/tuple of items of `kind` (bool is not an int here) as a list."""
    items = [] if value is None else [value] if isinstance(value, kind) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(x, kind) and not isinstance(x, bool)
                                                        for x in items):
        raise SamplingParamsError(f"{name} must be {allowed}, got {value!r}")
    return list(items)


MAX_LOGPROBS = 20  # OpenAI's ceiling for top_logprobs
MAX_SALT = 1024  # characters of a cache_salt
MAX_BIAS = 100.0  # OpenAI's range for logit_bias values: -100..100


@dataclass
class SamplingParams:
    """How to pick tokens. temperature 0 means greedy; top_k 0, top_p 1 and min_p 0 mean no cut.

    What a request changes about the model's logits, before temperature and the cuts
    (ssd/request/logits_process.py): repetition_penalty (> 1 discourages every token seen in
    the prompt or the output, as in transformers), presence_penalty / frequency_penalty
    (OpenAI's: subtracted once / per occurrence, output tokens only), logit_bias (token id ->
    bias added), min_tokens (end-of-sequence and stop tokens banned until that many tokens),
    and at most one constraint on the output (ssd/request/constraint.py, llguidance):
    json_schema (a JSON schema as a dict or JSON text; {"type": "object"} for any JSON
    object), regex, or grammar (Lark as llguidance reads it, or GBNF as llama.cpp writes it).
    logprobs: the emitted token's log-probability and that many top alternatives (0..20),
    from the logits after those changes (RequestOutput.logprobs). prompt_logprobs: the same
    for each prompt token after the first, under the model's own logits given the tokens
    before it (RequestOutput.prompt_logprobs: how a prompt is scored); such a request reads
    no cached prompt blocks (their positions' logits were never kept).
    cache_salt: the request's tenant: it shares cached prompt blocks only with requests of the
    same salt (None: with the other unsalted ones), so no caller learns from a fast answer
    that another caller's text was there (docs/algorithm.md, "KV caches").
    speculate: False decodes this request plainly (K 0 in every round) on an engine that
    speculates, to compare with plain decoding; its tokens are the same either way."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 256
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    json_schema: dict | str | None = None
    regex: str | None = None
    grammar: str | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    cache_salt: str | None = None
    speculate: bool = True

    def __post_init__(self) -> None:
        self.stop = _list(self.stop, str, "stop", "a string or a list of strings")
        if "" in self.stop:
            raise SamplingParamsError("stop strings must not be empty: an empty stop string would end "
                                      "generation before the first token")
        self.stop_token_ids = _list(self.stop_token_ids, int, "stop_token_ids", "a list of token ids")
        # Written so that NaN fails every range check.
        if not is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise SamplingParamsError(f"temperature must be >= 0 and finite (0: greedy), got {self.temperature!r}")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise SamplingParamsError(f"top_p must be in (0, 1] (1: no cut), got {self.top_p!r}")
        check_int("top_k", self.top_k, 0, also="(0: no cut)", error=SamplingParamsError)
        check_int("max_tokens", self.max_tokens, 1, error=SamplingParamsError)
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < MAX_SEED):
            raise SamplingParamsError(f"seed must be None or an integer in 0..2**64-1, got {self.seed!r}")
        if not is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise SamplingParamsError(f"min_p must be in [0, 1] (0: no cut), got {self.min_p!r}")
        check_int("min_tokens", self.min_tokens, 0, self.max_tokens, also="(at most max_tokens)",
                  error=SamplingParamsError)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_number(value) or not -2 <= value <= 2:
                raise SamplingParamsError(f"{name} must be in [-2, 2] (0: none), got {value!r}")
        if not is_number(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            raise SamplingParamsError(f"repetition_penalty must be > 0 and finite (1: none), "
                                      f"got {self.repetition_penalty!r}")
        self.logit_bias = self._bias(self.logit_bias)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 0, MAX_LOGPROBS, also="(alternatives to each token) or None",
                          error=SamplingParamsError)
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt
                                            or len(self.cache_salt) > MAX_SALT):
            raise SamplingParamsError(f"cache_salt must be a non-empty string of at most {MAX_SALT} characters, "
                                      f"got {self.cache_salt!r:.80}")
        if not isinstance(self.speculate, bool):
            raise SamplingParamsError(f"speculate must be True or False, got {self.speculate!r}")
        given = [n for n in ("json_schema", "regex", "grammar") if getattr(self, n) is not None]
        if len(given) > 1:
            raise SamplingParamsError(f"at most one of json_schema, regex and grammar, got {' and '.join(given)}")
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, str)):
            raise SamplingParamsError(f"json_schema must be a dict or JSON text, got {type(self.json_schema).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise SamplingParamsError(f"{name} must be a non-empty string, got {value!r}")

    @staticmethod
    def _bias(bias) -> dict[int, float]:
        """logit_bias as {token id: bias}; string keys as JSON carries them are read as ids."""
        if bias is None:
            return {}
        if not isinstance(bias, dict):
            raise SamplingParamsError(f"logit_bias must map token ids to biases, got {type(bias).__name__}")
        out = {}
        for key, value in bias.items():
            token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
            if not is_int(token) or token < 0:
                raise SamplingParamsError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
            if not is_number(value) or not -MAX_BIAS <= value <= MAX_BIAS:
                raise SamplingParamsError(f"logit_bias values must be in [-100, 100], got {value!r} for token {key}")
            out[token] = float(value)
        return out

    @property
    def constrained(self) -> bool:
        """Whether the output must follow a JSON schema, a regex or a grammar."""
        return self.json_schema is not None or self.regex is not None or self.grammar is not None

    @property
    def adjusts_logits(self) -> bool:
        """Whether the request changes the model's logits before drawing (penalties, bias,
        min_tokens, a constraint): ssd/request/logits_process.py."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens or self.constrained)

    @property
    def greedy_decoding(self) -> bool:
        return self.temperature == 0

    @classmethod
    def greedy(cls, **kw) -> "SamplingParams":
        return cls(temperature=0.0, **kw)

    @classmethod
    def creative(cls, **kw) -> "SamplingParams":
        return cls(**{"temperature": 1.0, "top_p": 0.95, **kw})

    @classmethod
    def conservative(cls, **kw) -> "SamplingParams":
        return cls(**{"temperature": 0.3, "top_k": 40, "top_p": 0.9, **kw})
