import dataclasses
import os
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

import torch
from tqdm import tqdm

from ssd.engine.detokenizer import TextStream
from ssd.engine.kv_cache import PagedKVCache
from ssd.engine.model_runner import Chunk, ModelRunner
from ssd.engine.sampler import next_tokens
from ssd.engine.scheduler import Scheduler, Work
from ssd.engine.sequence import Sequence
from ssd.checks import check_int
from ssd.config import EngineConfig
from ssd.errors import ContextLengthError, PromptError, SSDError
from ssd.models.loader import load_tokenizer, shared_model
from ssd.outputs import RequestOutput, StreamChunk
from ssd.sampling_params import SamplingParams
from ssd.speculative.adaptive_k import AutoK, FixedK, round_k
from ssd.speculative.launch import start_speculator
from ssd.speculative.options import AUTO_K
from ssd.speculative.round import speculative_round
from ssd.speculative.speculator import Speculator

Prompt = str | list[dict]


class LLM:
    """Generate text with one model: `LLM("smollm2-135m-instruct").generate(prompts, params)`.

    model / draft: a store name, a Hugging Face style folder or a .gguf file.
    mode: "ar" (plain decoding), "sd" (speculative decoding with the draft in this process)
    or "ssd" (speculative speculative decoding: the draft in a worker process on its own
    cores or GPU, precomputing the next speculation while the target verifies). Every mode
    gives the target's output exactly; see README.md for the options.
    """

    def __init__(self, model: str | os.PathLike, **options):
        """options: those of EngineConfig (ssd/config.py): draft, mode, device, dtype,
        max_model_len, threads, max_num_seqs, max_num_batched_tokens, kv_cache_tokens,
        block_size, seed, weights; and those of SpecOptions (ssd/speculative/options.py):
        speculate_k, draft_quantization, and for SSD fan_out, backup, target_device,
        draft_device, ... weights: how the model's weights are held: "gguf" (a GGUF model's own
        quantised blocks, the default for one on a CPU), "dequantized" (a copy in `dtype`: the
        values transformers loads, and what a GPU uses), "int8" or "q4_0" (requantised copies,
        which change the model's outputs: meant for a draft, see ssd/models/loader.py), or
        "auto". Every option is checked before any model loads or worker starts."""
        self.config = config = EngineConfig.from_options(model, options)
        spec = config.speculation
        self.k_max = spec.k_max
        torch.set_num_threads(config.threads)
        self.tokenizer = load_tokenizer(config.model)
        self.eos_ids = config.model_config.end_ids(self.tokenizer)
        self.speculator: Speculator | None = None if config.draft is None else \
            start_speculator(config, self.tokenizer)
        # The target loads while an SSD worker loads the draft.
        self.model = shared_model(config.model, config.device, config.dtype, config.weights)
        if self.speculator:
            self.speculator.wait_ready()
        self.cache = PagedKVCache(config.model_config, config.kv_cache_tokens, config.block_size, config.device,
                                  config.dtype)
        self.runner = ModelRunner(self.model, self.cache, config.device)
        self.runner.warm_up()
        self.speculate_k = spec.speculate_k if self.speculator else 0  # set_speculate_k() changes it
        # Drafts sit before the target's own token, and inside the draft model's context.
        draft_len = self.speculator.context if self.speculator else None
        self.draft_context = self.max_model_len - 1 if draft_len is None else min(self.max_model_len - 1, draft_len)
        self.k_policy = None if self.speculator is None else self._k_policy(spec.speculate_k)
        self.scheduler = Scheduler(self.cache, config.max_num_seqs, config.max_num_batched_tokens,
                                   lookahead=self.k_max if self.speculator else 0,
                                   on_release=self._release if self.speculator else None)
        self.generator = torch.Generator(config.device)
        self.generator.manual_seed(config.seed if config.seed is not None else int.from_bytes(os.urandom(8), "little"))

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def folder(self) -> Path:
        """The target model's folder."""
        return self.config.model

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def threads(self) -> int:
        return self.config.threads

    @property
    def weights(self) -> str:
        """How the target's weights are held ("auto" decided)."""
        return self.config.weights

    # ---- public API -------------------------------------------------------------------
    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One output per prompt. A prompt is a string or a chat: a list of {"role": "system" |
        "user" | "assistant", "content": str} messages, rendered with the model's chat template.
        sampling_params: one for all prompts, or a list of one per prompt. Every prompt is
        checked (PromptError, ContextLengthError) before any is run."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise PromptError(f"prompts must be a string, a chat (a list of messages) or a list of those, "
                              f"got {type(prompts).__name__}")
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise SSDError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params: "
                           "pass one SamplingParams for all prompts or a list of one per prompt")
        seqs = [self.new_request(p, sp) for p, sp in zip(prompts, sampling_params)]
        bar = tqdm(total=len(seqs), desc="generate", disable=not use_tqdm)
        for seq in seqs:
            self.add_request(seq)
        try:
            while self.scheduler.has_work:
                for seq, _, _ in self.step():
                    if seq.finished:
                        bar.update(1)
        finally:
            bar.close()
            self.abort(seqs)
        return [self._output(s) for s in seqs]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None
               ) -> Iterator[StreamChunk]:
        """Yield StreamChunks as tokens are made; the last one has finish_reason and metrics."""
        seq = self.new_request(prompt, sampling_params or SamplingParams())
        self.add_request(seq)
        try:
            while not seq.finished:
                for s, new, from_draft in self.step():
                    if s is seq:
                        text = seq.text.take(final=seq.finished)
                        yield StreamChunk(text, new, from_draft,
                                          seq.finish_reason, seq.metrics() if seq.finished else None)
        finally:
            self.abort([seq])

    # ---- driving the engine step by step (ssd/serving/engine_loop.py) -----------------
    def new_request(self, prompt: Prompt, params: SamplingParams, fill_context: bool = False) -> Sequence:
        """A checked request, not yet scheduled: PromptError, ContextLengthError or
        SamplingParamsError here. Only tokenizes, so another thread may call it while
        the engine steps. fill_context: max_tokens is what the context leaves after the
        prompt (OpenAI's chat default)."""
        if not isinstance(params, SamplingParams):
            raise SSDError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        ids = self.encode(prompt)
        if not ids:
            raise PromptError("the prompt encodes to no tokens")
        if fill_context:
            params = dataclasses.replace(params, max_tokens=max(1, self.max_model_len - len(ids)))
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ContextLengthError(
                f"context length exceeded: the prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}, "
                f"{len(ids) + params.max_tokens} in all, but the context holds {self.max_model_len} tokens; "
                + (f"lower max_tokens to at most {self.max_model_len - len(ids)}" if len(ids) < self.max_model_len
                   else "shorten the prompt"))
        gen = None
        if params.seed is not None:
            gen = torch.Generator(self.config.device)
            gen.manual_seed(params.seed)
        label = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        return Sequence(label, ids, params, TextStream(self.tokenizer, params.stop), gen or self.generator)

    def add_request(self, seq: Sequence) -> None:
        """Queue a request from new_request(); it joins the running batch at a later step."""
        self.scheduler.add(seq)

    def step(self) -> list[tuple[Sequence, list[int], list[bool]]]:
        """Run one scheduled step; return (sequence, new tokens, from_draft flags) for each
        sequence that got tokens. Prompt chunks run through the target alone; in SD and SSD
        modes the sequences that are decoding run one speculative round."""
        work = self.scheduler.schedule()
        decoding = [w.seq for w in work if self.speculator and w.num_new == 1 and w.samples]
        plain = [w for w in work if w.seq not in decoding]
        with self.speculator.placement(drafting=bool(decoding)) if self.speculator else nullcontext():
            events = self._forward(plain) if plain else []
            return events + (self._speculate(decoding) if decoding else [])

    def abort(self, seqs: list[Sequence]) -> None:
        """Stop unfinished requests and free what they hold (KV blocks, the draft's state)."""
        for seq in seqs:
            if not seq.finished:
                self.scheduler.finish(seq)

    def kv_blocks_in_use(self) -> int:
        """The target's KV cache blocks held by requests (0 when none is in flight)."""
        return self.cache.blocks_in_use

    def set_speculate_k(self, k: int | str) -> None:
        """Change K for the next rounds: 0 (plain decoding, the draft idle) up to the K the
        engine was started with (its KV room per round), or "auto" (`ssd chat`'s /k, /mode)."""
        if self.speculator is None:
            raise SSDError("there is no draft model: speculation needs mode 'sd' or 'ssd'")
        if k != AUTO_K:
            check_int("K", k, 0, self.k_max, also=f"(the most this engine was started with) or '{AUTO_K}'")
        self.k_policy, self.speculate_k = self._k_policy(k), k

    def _k_policy(self, k: int | str) -> FixedK | AutoK:
        if k != AUTO_K:
            return FixedK(k)
        return AutoK(self.k_max, lambda rows: self.runner.timed_pass(rows, repeat=2), self.speculator.step_cost(),
                     self.speculator.measures_steps)

    @property
    def draft_failures(self) -> int:
        """How often the SSD draft worker failed to start, died or hung (SD took over)."""
        return self.speculator.failures if self.speculator else 0

    def close(self) -> None:
        """Free the requests in flight and stop the draft worker, if any. Idempotent."""
        self.abort(list(self.scheduler.running) + list(self.scheduler.waiting))
        if self.speculator is not None:
            self.speculator.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals --------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise PromptError("the prompt is empty")
            return self.tokenizer(prompt).input_ids
        self._check_chat(prompt)
        if not self.tokenizer.chat_template:
            raise PromptError(f"model {self.folder.name} has no chat template; pass a plain string")
        text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    @staticmethod
    def _check_chat(chat) -> None:
        roles = ("system", "user", "assistant")
        if not isinstance(chat, list):
            raise PromptError(f"a prompt must be a string or a chat (a list of {{'role': ..., 'content': ...}} "
                              f"messages), got {type(chat).__name__}")
        if not chat:
            raise PromptError("the chat is empty: it needs at least one {'role': ..., 'content': ...} message")
        if all(isinstance(t, int) for t in chat):
            raise PromptError("token ids are not accepted as a prompt; pass the text or a chat")
        for i, m in enumerate(chat):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise PromptError(f"chat message {i} must be a dict with 'role' and 'content', got {m!r}")
            if m["role"] not in roles:
                raise PromptError(f"chat message {i} has role {m['role']!r}; allowed roles: {', '.join(roles)}")
            if not isinstance(m["content"], str):
                raise PromptError(f"chat message {i} has content of type {type(m['content']).__name__}; "
                                  "content must be a string")

    def _forward(self, work: list[Work]) -> list[tuple[Sequence, list[int], list[bool]]]:
        logits = self.runner.forward([Chunk(w.seq.seq_id, w.seq.token_ids[w.seq.num_cached:][:w.num_new],
                                            w.seq.num_cached, int(w.samples)) for w in work])
        now = time.perf_counter()
        events, row = [], 0
        for w in work:
            seq, samples = w.seq, w.samples
            seq.num_cached += w.num_new
            if not samples:
                continue
            token = int(next_tokens(logits[row:row + 1], seq.params, seq.generator)[0])
            row += 1
            events.append(self._append(seq, [token], [False], now))
        return events

    def _speculate(self, seqs: list[Sequence]) -> list[tuple[Sequence, list[int], list[bool]]]:
        """One speculative round (ssd/speculative/round.py) for the sequences that are decoding."""
        ks = [round_k(k, s.num_tokens, self.draft_context, s.params.max_tokens - len(s.output_ids))
              for s, k in zip(seqs, self.k_policy.choose(seqs))]
        if not any(ks):  # plain decoding this round: no draft pass; the draft catches up when next asked
            start = time.perf_counter()
            events = self._forward([Work(s, 1) for s in seqs])
            verify_s = time.perf_counter() - start
            self.k_policy.observe(seqs, [0] * len(seqs), [0] * len(seqs), 0.0, verify_s)
            for seq in seqs:
                seq.stats.record_round(0, 0, 0, 0.0, verify_s)
            return events
        results = speculative_round(self.speculator, self.runner, seqs, ks)
        self.k_policy.observe(seqs, [len(r.proposal.tokens) for r in results], [r.accepted for r in results],
                              results[0].draft_s, results[0].verify_s, self.speculator.last_step_s(),
                              self.speculator.last_catchup())
        now = time.perf_counter()
        events = []
        for seq, k, r in zip(seqs, ks, results):
            st, p = seq.stats, r.proposal
            st.tree_s += p.tree_s
            st.draft_idle_s += p.idle_s
            st.backup_s += p.backup_s
            st.draft_failures += p.failed_over
            st.record_round(k, len(p.tokens), r.accepted, r.draft_s, r.verify_s, p.hit if self.mode == "ssd" else None)
            events.append(self._append(seq, r.tokens, [True] * r.accepted + [False], now))
        return events

    def _release(self, seq: Sequence) -> None:
        self.speculator.release(seq)
        self.k_policy.release(seq)

    def _append(self, seq: Sequence, tokens: list[int], from_draft: list[bool], now: float
                ) -> tuple[Sequence, list[int], list[bool]]:
        """Add tokens up to the first that finishes the sequence; return what was added."""
        for i, token in enumerate(tokens):
            seq.token_ids.append(token)
            seq.from_draft.append(from_draft[i])
            seq.text.push([token])
            seq.first_token_at = seq.first_token_at or now
            seq.last_token_at = now
            p = seq.params
            if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids or seq.text.stopped:
                seq.finish_reason = "stop"
            elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                seq.finish_reason = "length"
            if seq.finished:
                self.scheduler.finish(seq)
                return seq, tokens[:i + 1], from_draft[:i + 1]
        return seq, tokens, from_draft

    def _output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(seq.prompt, seq.text.text, list(seq.output_ids),
                             seq.finish_reason or "length", seq.metrics(), list(seq.from_draft))
