"""A request's constraint on its output: a JSON schema, a regex or a grammar, followed token
by token with llguidance (bench/studies/grammar_mask.py measured it against xgrammar on the Qwen
vocabulary: both compute a mask in well under 1 % of a decode step; llguidance needs no
compiler run per schema, reads Lark and regexes as well as JSON schemas, names what is
wrong with a bad one, and installs as one small wheel where xgrammar brings triton along).

The engine's `Grammars` compiles a request's constraint against the model's vocabulary; each
request gets a `Constraint` (the target's), and the SD draft a copy of its own
(`Constraint.fork`). A constraint's state is a function of the output tokens it was led
through: `follow(output)` rolls back past tokens that are no longer there (rejected drafts)
and consumes the new ones, so either side can try draft tokens and be put right afterwards.
"""
import json
import threading

import torch

from ssd.errors import GrammarError
from ssd.sampling_params import SamplingParams

_BITS = torch.arange(32, dtype=torch.int32)


class Grammars:
    """Compiles constraints for one model: llguidance's view of its tokenizer is built on the
    first constrained request (a few seconds on a CPU), then kept."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int]):
        self.hf_tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        # Special tokens other than the end tokens: llguidance's mask can allow one where the
        # grammar's text spells it, and then refuses to consume it (Constraint.allowed).
        self.special = sorted(i for i, t in tokenizer.added_tokens_decoder.items()
                              if t.special and i < vocab_size and i not in eos_ids)
        self._tokenizer = None
        self._lock = threading.Lock()  # new_request may run in the server's threads

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf
                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                                   eos_token=self.eos_ids)
                except ValueError as e:
                    raise GrammarError(f"this model's tokenizer cannot be read for a constraint (llguidance: {e}); "
                                       "leave out json_schema, regex and grammar") from None
            return self._tokenizer

    def compile(self, params: SamplingParams) -> "Constraint | None":
        """The request's constraint, in its start state; GrammarError naming what is wrong with
        a schema, regex or grammar that cannot be followed (checked before any decoding)."""
        if not params.constrained:
            return None
        import llguidance
        name, grammar = self._grammar(params)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if failed:
            raise GrammarError(f"{name}: {messages[0].strip()}")
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{name}: {matcher.get_error().strip()}")
        return Constraint(matcher, self.vocab_size, self.special, self.eos_ids)

    @staticmethod
    def _grammar(params: SamplingParams) -> tuple[str, str]:
        from llguidance import LLMatcher, gbnf_to_lark
        if params.json_schema is not None:
            schema = params.json_schema
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise GrammarError(f"json_schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise GrammarError(f"json_schema must be a JSON object (a schema), got {type(schema).__name__}")
            try:
                return "json_schema", LLMatcher.grammar_from_json_schema(schema)
            except (ValueError, TypeError) as e:
                raise GrammarError(f"json_schema: {e}") from None
        if params.regex is not None:
            return "regex", LLMatcher.grammar_from_regex(params.regex)
        text = params.grammar
        if "::=" in text:  # GBNF, as llama.cpp writes grammars
            try:
                text = gbnf_to_lark(text)
            except Exception as e:  # the converter raises plain Exceptions on bad input
                raise GrammarError(f"grammar (GBNF): {e}") from None
        return "grammar", LLMatcher.grammar_from_lark(text)


class Constraint:
    """One request's grammar state (an llguidance matcher) and the tokens it consumed."""

    def __init__(self, matcher, vocab_size: int, special: list[int] = (), end_ids: list[int] = ()):
        self.matcher, self.vocab_size = matcher, vocab_size
        self.special, self.end_ids = torch.tensor(special, dtype=torch.long), torch.tensor(end_ids, dtype=torch.long)
        self.consumed: list[int] = []
        self._mask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
        self._allowed: torch.Tensor | None = None  # allowed() in the present state (a draft step asks twice)

    def fork(self) -> "Constraint":
        """An independent copy in the same state (the SD draft's)."""
        copy = Constraint(self.matcher.deep_copy(), self.vocab_size, self.special.tolist(), self.end_ids.tolist())
        copy.consumed = list(self.consumed)
        return copy

    def follow(self, output: list[int]) -> None:
        """Be in the state after `output`: roll back what differs, consume what is new. Tokens
        after the grammar stopped (end tokens a draft proposed past it) are not consumed:
        llguidance keeps no history of them to roll back."""
        a, n = self.consumed, min(len(self.consumed), len(output))
        same = n if a[:n] == output[:n] else next(i for i in range(n) if a[i] != output[i])
        if same < len(a):
            self.matcher.rollback(len(a) - same)
            del a[same:]
            self._allowed = None
        for token in output[same:]:
            if self.matcher.is_stopped():
                break
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"constraint: token {token} after {len(a)} tokens broke the grammar: "
                                   f"{self.matcher.get_error()}")
            a.append(token)
            self._allowed = None

    def allowed(self) -> torch.Tensor:
        """The tokens the grammar allows next, as a bool row [vocab_size]. A special token the
        mask allows is tried, and dropped if the matcher would refuse it; a grammar left with
        no token allows the end tokens (the request ends rather than fails). The row is the
        constraint's own: a caller does not change it."""
        if self._allowed is not None:
            return self._allowed
        import llguidance.torch
        llguidance.torch.fill_next_token_bitmask(self.matcher, self._mask, 0)
        allowed = ((self._mask.view(-1, 1) >> _BITS) & 1).view(-1)[:self.vocab_size].bool()
        if self.special.numel() and not self.matcher.is_stopped():
            for t in self.special[allowed[self.special]].tolist():
                if self.matcher.try_consume_tokens([t]) == 1:
                    self.matcher.rollback(1)
                else:
                    allowed[t] = False
        if not allowed.any():
            allowed[self.end_ids] = True
        self._allowed = allowed
        return allowed

    def advance(self, token: int) -> None:
        """Consume a token the last allowed() row allows (a draft token under test)."""
        if self.matcher.is_stopped():
            return
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"constraint: allowed token {token} was refused: {self.matcher.get_error()}")
        self.consumed.append(token)
        self._allowed = None

    @property
    def stopped(self) -> bool:
        """Whether the output is complete: the grammar allows nothing more (but an end token)."""
        return self.matcher.is_stopped()
