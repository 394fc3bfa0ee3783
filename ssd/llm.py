import bisect
import dataclasses
import functools
import json
import os
from collections.abc import Iterator

import torch
from tqdm import tqdm

from ssd.checks import is_int
from ssd.config import EngineConfig
from ssd.engine.llm_engine import LLMEngine
from ssd.errors import ContextLengthError, PromptError, SSDError
from ssd.models.loader import load_tokenizer
from ssd.outputs import RequestOutput, StreamChunk
from ssd.request.detokenizer import TextStream
from ssd.request.noise import request_noise
from ssd.request.sequence import Sequence
from ssd.sampling_params import SamplingParams
from ssd.tools import CallStream, ToolCall, ToolError, ToolFormat, Tools, finish_reason, template_messages

Prompt = str | list[dict] | list[int]  # text, a chat, or token ids read as they are


class LLM:
    """Generate text with one model: `LLM("smollm2-135m-instruct").generate(prompts, params)`.

    model / draft: a store name, a Hugging Face hub id ("org/name", "org/name@REV",
    "org/name:Q4_K_M"; docs/models.md), a Hugging Face style folder or a .gguf file.
    mode: "ar" (plain decoding), "sd" (speculative decoding with the draft in this process)
    or "ssd" (speculative speculative decoding: the draft in a worker process on its own
    cores or GPU, precomputing the next speculation while the target verifies). Every mode
    gives the target's output exactly; see README.md for the options.
    """

    def __init__(self, model: str | os.PathLike, **options):
        """options: those of EngineConfig (ssd/config.py): draft, mode, device, dtype,
        max_model_len, threads, max_num_seqs, max_num_batched_tokens, kv_cache_tokens,
        block_size, seed, weights, enable_prefix_caching, cuda_graph_rows, and tensor
        parallelism's tensor_parallel_size, tensor_parallel_address and
        tensor_parallel_timeout; and those of SpecOptions (ssd/speculative/options.py):
        speculate_k, k_max, draft_quantization, draft_vocab, ..., and for SSD fan_out, backup,
        target_device, draft_device, ... weights: how the model's weights are held: "gguf" (a GGUF model's own
        quantised blocks, the default for one on a CPU), "dequantized" (a copy in `dtype`: the
        values transformers loads, and what a GPU uses), "int8" or "q4_0" (requantised copies,
        which change the model's outputs: meant for a draft, see ssd/models/loader.py), or
        "auto". Every option is checked before any model loads or worker starts."""
        self.config = EngineConfig.from_options(model, options)
        torch.set_num_threads(self.config.threads)
        self.tokenizer = load_tokenizer(self.config.model)
        self.engine = LLMEngine(self.config, self.tokenizer)
        self.generator = torch.Generator(self.config.device)  # for requests without a seed of their own
        seed = self.config.seed
        self.generator.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))

    @property
    def eos_ids(self) -> set[int]:
        return self.engine.eos_ids

    @property
    def speculate_k(self) -> int | str:
        """The K of the next rounds (0 without a draft): set_speculate_k() changes it."""
        return self.engine.speculate_k

    # ---- public API -------------------------------------------------------------------
    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, tools: Tools | list[dict] | None = None) -> list[RequestOutput]:
        """One output per prompt. A prompt is a string, a chat: a list of {"role": "system" |
        "user" | "assistant" | "tool", "content": str} messages (an assistant's may carry
        OpenAI's "tool_calls"), rendered with the model's chat template, or token ids.
        sampling_params: one for all prompts, or a list of one per prompt. tools: OpenAI's
        function definitions, or Tools(definitions, choice, parallel) (ssd/tools.py), for chats
        with a model whose template renders tools; the outputs then carry tool_calls. Every
        prompt is checked (PromptError, ContextLengthError, ToolError) before any is run."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and (isinstance(prompts[0], dict) or is_int(prompts[0]))):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise PromptError(f"prompts must be a string, a chat (a list of messages), token ids or a list of "
                              f"those, got {type(prompts).__name__}")
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise SSDError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params: "
                           "pass one SamplingParams for all prompts or a list of one per prompt")
        seqs = [self.new_request(p, sp, tools=tools) for p, sp in zip(prompts, sampling_params)]
        bar = tqdm(total=len(seqs), desc="generate", disable=not use_tqdm)
        for seq in seqs:
            self.add_request(seq)
        try:
            while self.unfinished():
                # The engine's step: outputs are read whole at the end, so no step becomes a chunk.
                bar.update(sum(seq.finished for seq, *_ in self.engine.step()))
        finally:
            bar.close()
            self.abort(seqs)
        return [self._output(s) for s in seqs]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
               tools: Tools | list[dict] | None = None) -> Iterator[StreamChunk]:
        """Yield StreamChunks as tokens are made; the last one has finish_reason and metrics
        (and with tools, tool_calls: a call's text is not streamed as content)."""
        seq = self.new_request(prompt, sampling_params or SamplingParams(), tools=tools)
        self.add_request(seq)
        try:
            while not seq.finished:
                yield from (chunk for s, chunk in self.step() if s is seq)
        finally:
            self.abort([seq])

    # ---- driving the engine step by step (ssd/serving/engine_loop.py) -----------------
    def new_request(self, prompt: Prompt, params: SamplingParams, fill_context: bool = False,
                    tools: Tools | list[dict] | None = None) -> Sequence:
        """A checked request, not yet scheduled: PromptError, ContextLengthError,
        SamplingParamsError or ToolError here. Only tokenizes, so another thread may call it
        while the engine steps. fill_context: max_tokens is what the context leaves after the
        prompt (OpenAI's chat default). tools: see generate()."""
        if not isinstance(params, SamplingParams):
            raise SSDError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if tools is not None:
            tools, params = self._tools(prompt, params, tools)
        text, ids = self._encode(prompt, tools)
        if not ids:
            raise PromptError("the prompt encodes to no tokens")
        context = self.config.max_model_len
        if fill_context:
            params = dataclasses.replace(params, max_tokens=max(1, context - len(ids)))
        if len(ids) + params.max_tokens > context:
            # OpenAI's wording, which clients match to tell an overflow from other errors (litellm's
            # ContextWindowExceededError and the context fallbacks behind it).
            where = "prompt" if isinstance(prompt, str) else "messages"
            raise ContextLengthError(
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the {where}, {params.max_tokens} in the "
                f"completion). Please reduce the length of the {where} or completion: "
                + (f"max_tokens at most {context - len(ids)}" if len(ids) < context else f"a shorter {where}") + ".")
        gen = None
        if params.seed is not None:
            gen = torch.Generator(self.config.device)
            gen.manual_seed(params.seed)
        processor = self.engine.processor(params, len(ids))
        calls = CallStream(self.tool_format, self._end_texts(), tools.names, tools.parallel) \
            if tools and tools.calls_parsed else None
        return Sequence(text, ids, params, TextStream(self.tokenizer, params.stop), gen or self.generator,
                        noise=request_noise(params, self.config.seeded_sampling), processor=processor, tools=tools,
                        calls=calls)

    def tool_calls(self, seq: Sequence) -> tuple[str, list[ToolCall]] | None:
        """A finished request's content and tool calls; None where it had no tools, or
        tool_choice "none"."""
        if seq.tools is None or not seq.tools.calls_parsed:
            return None
        fmt = self.tool_format
        return fmt.parse(fmt.text(seq.output_ids), self._end_texts(), seq.tools.names, seq.tools.parallel)

    @functools.cached_property
    def tool_format(self) -> ToolFormat:
        """How this model writes tool calls (read from its tokenizer once)."""
        return ToolFormat(self.tokenizer)

    def _end_texts(self) -> tuple[str, ...]:
        return tuple(self.tokenizer.decode([t]) for t in self.eos_ids)

    def _tools(self, prompt: Prompt, params: SamplingParams, tools: Tools | list[dict]
               ) -> tuple[Tools, SamplingParams]:
        """The request's tools, checked against this model; for tool_choice "required" or a
        named function, the params gain the grammar of valid calls."""
        tools = _checked(tools)
        if isinstance(prompt, str):
            raise ToolError("tools need a chat (a list of messages), not a plain prompt", "tools")
        if not ToolFormat.supported(self.tokenizer):
            raise ToolError(f"model {self.config.model.name}'s chat template has no tool support "
                            "(it renders no tools and no <tool_call>)", "tools")
        if params.stop and tools.calls_parsed:
            raise ToolError("stop strings cannot be combined with tools (a call may contain them)", "stop")
        grammar = self.tool_format.grammar(tools)
        if grammar is not None:
            if params.constrained:
                raise ToolError(f"tool_choice {tools.choice!r} makes the output a tool call; it cannot also follow "
                                "a response_format, json_schema, regex or grammar", "tool_choice")
            params = dataclasses.replace(params, grammar=grammar)
        return tools, params

    def add_request(self, seq: Sequence) -> None:
        """Queue a request from new_request(); it joins the running batch at a later step."""
        self.engine.scheduler.add(seq)

    def step(self) -> list[tuple[Sequence, StreamChunk]]:
        """Run one scheduled step (ssd/engine/llm_engine.py); return what it made for each
        sequence that got tokens. The one place a step becomes a chunk: its new text (a tool
        request's content, its calls with its last tokens), logprobs, how it finished and, at
        the end, its metrics."""
        out = []
        for seq, new, sources, step in self.engine.step():
            text = seq.detokenizer.take(final=seq.finished)
            pieces = _pieces(seq, seq.detokenizer.emitted - len(text), seq.detokenizer.emitted)
            calls = []
            if seq.calls is not None:
                text, calls = seq.calls.step(new, seq.finished)
                pieces = None
            lps = None if seq.params.logprobs is None else seq.logprobs[len(seq.logprobs) - len(new):]
            metrics = seq.metrics() if seq.finished else None
            out.append((seq, StreamChunk(text, new, [s is not None for s in sources],
                                         finish_reason(seq.finish_reason, calls), metrics, lps, calls or None,
                                         sources=sources, pieces=pieces, step=step)))
        return out

    def abort(self, seqs: list[Sequence]) -> None:
        """Stop unfinished requests and free what they hold (KV blocks, the draft's state)."""
        for seq in seqs:
            if not seq.finished:
                self.engine.finish(seq)

    # ---- what is in flight, for a loop that drives the engine (ssd/serving/) ------------
    @property
    def num_running(self) -> int:
        """Requests in the running batch."""
        return len(self.engine.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests added and waiting for a place in the running batch."""
        return len(self.engine.scheduler.waiting)

    def unfinished(self) -> list[Sequence]:
        """Requests added and not finished: the running batch, then those waiting."""
        return self.engine.scheduler.running + list(self.engine.scheduler.waiting)

    def sequence_state(self) -> dict[str, int]:
        """What the engine holds per request, by structure (sequences known, KV cache owners and
        blocks, here and on the draft's side, an SSD worker's included): all 0 when no request
        is in flight. A check for leaks; an SSD worker is asked over its link."""
        return self.engine.registry.held()

    def kv_blocks_in_use(self) -> int:
        """The target's KV cache blocks held by requests (0 when none is in flight)."""
        return self.engine.cache.blocks_in_use

    @property
    def kv_blocks_total(self) -> int:
        """The target's KV cache blocks."""
        return self.engine.cache.num_blocks

    def kv_blocks_cached(self) -> int:
        """The target's KV cache blocks that hold a named prefix (held by requests or not)."""
        return self.engine.cache.cached_blocks

    def draft_kv_blocks_in_use(self) -> int | None:
        """The SD draft's KV cache blocks held by requests; None where there is no draft model in
        this process (AR, prompt lookup, an SSD worker's cache in its own process)."""
        source = self.engine.source
        return source.kv_blocks_in_use() if source else None

    def suffix_index_tokens(self) -> int:
        """Tokens of earlier requests held for suffix decoding (draft="suffix", or beside the
        draft with prompt_lookup="suffix"): at most suffix_tokens."""
        return self.engine.suffix_index.tokens

    def set_speculate_k(self, k: int | str) -> None:
        """Change K for the next rounds: 0 (plain decoding, the draft idle) up to the K the
        engine was started with (its KV room per round), or "auto" (`ssd chat`'s /k, /mode)."""
        self.engine.set_speculate_k(k)

    @property
    def draft_failures(self) -> int:
        """How often the SSD draft worker failed to start, died or hung (SD took over)."""
        source = self.engine.source
        return source.failures if source else 0

    def close(self) -> None:
        """Free the requests in flight and stop the draft worker, if any. Idempotent."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals --------------------------------------------------------------------
    def encode(self, prompt: Prompt, tools: Tools | list[dict] | None = None) -> list[int]:
        """The prompt's token ids (a chat rendered with the tools, as render() says)."""
        return self._encode(prompt, _checked(tools))[1]

    def render(self, prompt: Prompt, tools: Tools | list[dict] | None = None) -> str:
        """The text the model reads for this prompt: a chat rendered with the model's chat
        template and the tools (what another engine is given to read the same prompt)."""
        return self._encode(prompt, _checked(tools))[0]

    def _encode(self, prompt: Prompt, tools: Tools | None = None) -> tuple[str, list[int]]:
        """The text the model reads (a chat rendered with the model's chat template, with the
        tools), and its ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise PromptError("the prompt is empty")
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
            vocab = self.config.model_config.vocab_size
            outside = next((t for t in prompt if not 0 <= t < vocab), None)
            if outside is not None:
                raise PromptError(f"the prompt's token id {outside} is outside the vocabulary of {vocab} tokens")
            if tools is not None:
                raise PromptError("tools need a chat (a list of messages), not token ids")
            return self.tokenizer.decode(prompt), [int(t) for t in prompt]
        self._check_chat(prompt)
        if not self.tokenizer.chat_template:
            raise PromptError(f"model {self.config.model.name} has no chat template; pass a plain string")
        if any(m["role"] == "tool" or m.get("tool_calls") for m in prompt) and not ToolFormat.supported(self.tokenizer):
            raise PromptError(f"model {self.config.model.name}'s chat template has no tool support: the chat has "
                              "tool calls or tool messages")
        text = self.tokenizer.apply_chat_template(template_messages(prompt), tools=tools and tools.definitions,
                                                  add_generation_prompt=True, tokenize=False)
        return text, self.tokenizer(text, add_special_tokens=False).input_ids

    @staticmethod
    def _check_chat(chat) -> None:
        roles = ("system", "user", "assistant", "tool")
        if not isinstance(chat, list):
            raise PromptError(f"a prompt must be a string, a chat (a list of {{'role': ..., 'content': ...}} "
                              f"messages) or token ids, got {type(chat).__name__}")
        if not chat:
            raise PromptError("the chat is empty: it needs at least one {'role': ..., 'content': ...} message")
        for i, m in enumerate(chat):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise PromptError(f"chat message {i} must be a dict with 'role' and 'content', got {m!r}")
            if m["role"] not in roles:
                raise PromptError(f"chat message {i} has role {m['role']!r}; allowed roles: {', '.join(roles)}")
            calls = m.get("tool_calls")
            if calls is not None:
                LLM._check_calls(i, m, calls)
            if not isinstance(m["content"], str) and not (calls and m["content"] is None):
                raise PromptError(f"chat message {i} has content of type {type(m['content']).__name__}; "
                                  "content must be a string")

    @staticmethod
    def _check_calls(i: int, m: dict, calls) -> None:
        if m["role"] != "assistant" or not isinstance(calls, list):
            raise PromptError(f"chat message {i}: tool_calls must be a list, on an assistant message")
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise PromptError(f"chat message {i}: tool_calls[{j}] needs a function with a name")
            args = fn.get("arguments", "{}")
            try:
                if not isinstance(json.loads(args) if isinstance(args, str) else args, dict):
                    raise ValueError
            except ValueError:
                raise PromptError(f"chat message {i}: tool_calls[{j}].function.arguments must be a JSON object, "
                                  f"got {args!r}") from None

    def _output(self, seq: Sequence) -> RequestOutput:
        text, calls = self.tool_calls(seq) or (seq.output_text, [])
        finished = finish_reason(seq.finish_reason, calls) or "length"
        return RequestOutput(seq.prompt, text, list(seq.output_ids), finished,
                             seq.metrics(), seq.from_draft,
                             None if seq.params.logprobs is None else list(seq.logprobs), calls or None,
                             seq.token_ids[:seq.num_prompt_tokens],
                             None if seq.params.prompt_logprobs is None else list(seq.prompt_logprobs),
                             list(seq.sources))


def _pieces(seq: Sequence, start: int, end: int) -> list[tuple[str, str | None]]:
    """Characters start..end of seq's output text cut where the token that wrote them changes
    source, each piece with that source (StreamChunk.pieces). Token i wrote the characters
    between text_ends[i - 1] and text_ends[i]: what decoding it made stable, so a character
    held back (a partial UTF-8 sequence, a possible stop string) counts as the later token's."""
    text, ends, out = seq.detokenizer.text, seq.text_ends, []
    i = bisect.bisect_right(ends, start)
    while start < end:
        stop = min(ends[i] if i < len(ends) else end, end)
        source = seq.sources[i] if i < len(ends) else None
        if stop > start:
            if out and out[-1][1] == source:
                out[-1] = (out[-1][0] + text[start:stop], source)
            else:
                out.append((text[start:stop], source))
        start, i = stop, i + 1
    return out


def _checked(tools: Tools | list[dict] | None) -> Tools | None:
    """OpenAI's function definitions as Tools, checked (Tools and None as they are)."""
    return tools if tools is None or isinstance(tools, Tools) else Tools.check(tools)
