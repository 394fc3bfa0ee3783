"""The same tokenised prompts through peer engines (transformers, llama.cpp), greedy only,
timed the way our engine times itself: TTFT from the call to the first output token, and
decode speed as the tokens after the first chunk over the time after it.

A peer that is not installed or cannot load the model gives a PeerSkip with the reason."""
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import transformers

from ssd.models.loader import transformers_kwargs
from transformers.generation.streamers import BaseStreamer


@dataclass
class PeerResult:
    peer: str  # "hf", "hf-assisted", "llamacpp", "llamacpp-spec", "llamacpp-lookup"
    prompt_id: str
    token_ids: list[int]
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None
    decode_s: float
    tokens_per_second: float  # decode tokens / decode seconds


@dataclass
class PeerSkip:
    peer: str
    reason: str


def isolated(peer: str, run: Callable[..., list[PeerResult] | PeerSkip], *args, **kwargs
             ) -> list[PeerResult] | PeerSkip:
    """run(*args, **kwargs) in a child process: a crash in a peer's native code (llama.cpp's
    AMX path segfaults on prompts of several tokens on some CPUs) is reported as a skip
    instead of ending the benchmark, and the peer's memory is all returned when it ends."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            return pool.submit(run, *args, **kwargs).result()
        except BrokenProcessPool:
            return PeerSkip(peer, "the peer's process crashed (for llama-cpp-python built natively on a CPU with "
                                  "AMX, rebuild it without AMX: bench/llamacpp.sh)")


def _result(peer: str, prompt_id: str, prompt_len: int, token_ids: list[int], start: float,
            chunk_times: list[float], chunk_sizes: list[int]) -> PeerResult:
    """Timings from when each chunk of output tokens became available. The tokens of the
    first chunk are the first token's (an assisted first step can return several); the
    decode speed counts the rest over the time after that chunk."""
    decode_s = chunk_times[-1] - chunk_times[0] if chunk_times else 0.0
    decode_tokens = sum(chunk_sizes[1:])
    return PeerResult(peer, prompt_id, token_ids, prompt_len, len(token_ids),
                      chunk_times[0] - start if chunk_times else None, decode_s,
                      decode_tokens / decode_s if decode_s > 0 else 0.0)


def _check(prompt_token_ids: Sequence[Sequence[int]], prompt_ids: Sequence[str], max_tokens: int) -> None:
    if len(prompt_token_ids) != len(prompt_ids):
        raise ValueError(f"{len(prompt_token_ids)} prompts but {len(prompt_ids)} prompt ids")
    if max_tokens < 1 or any(len(p) == 0 for p in prompt_token_ids):
        raise ValueError("max_tokens must be at least 1 and every prompt non-empty")


class _Clock(BaseStreamer):
    """A transformers streamer that records when generate() hands over each chunk of new
    tokens; the first put is the prompt. Off Apple's mps, generate() puts each chunk right
    after the forward pass that produced it (.cpu() waits for it), so these are the times
    the tokens existed.
    Timing a separate 1-token generate for TTFT would double the prefill and miss the
    assisted first step, which returns several tokens."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.sizes: list[int] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())
        self.sizes.append(value.numel())

    def end(self) -> None:
        pass


def run_hf(target_folder: str | os.PathLike, prompt_token_ids: Sequence[Sequence[int]],
           prompt_ids: Sequence[str], max_tokens: int, *, draft_folder: str | os.PathLike | None = None,
           dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", ignore_eos: bool = False,
           threads: int | None = None, num_draft: int = 4) -> list[PeerResult] | PeerSkip:
    """Greedy `generate()` of stock transformers, batch 1; with `draft_folder`, assisted
    generation ("hf-assisted") drafting a constant `num_draft` tokens a step."""
    peer = "hf-assisted" if draft_folder is not None else "hf"
    _check(prompt_token_ids, prompt_ids, max_tokens)
    old_threads = torch.get_num_threads()
    try:
        if threads is not None:
            torch.set_num_threads(threads)

        def load(folder: str | os.PathLike) -> transformers.PreTrainedModel:
            return transformers.AutoModelForCausalLM.from_pretrained(
                folder, dtype=dtype, **transformers_kwargs(Path(folder))).to(device).eval()

        model = load(target_folder)
        kwargs: dict = {"do_sample": False}
        if draft_folder is not None:
            draft = load(draft_folder)
            # A fixed K like ours: no growing/shrinking schedule, no confidence cut-off.
            draft.generation_config.num_assistant_tokens = num_draft
            draft.generation_config.num_assistant_tokens_schedule = "constant"
            draft.generation_config.assistant_confidence_threshold = 0.0
            kwargs["assistant_model"] = draft
        if ignore_eos:
            # Keep going past EOS, EOS included in the output (min_new_tokens would instead
            # forbid EOS and change the greedy tokens).
            kwargs["eos_token_id"] = None

        def generate(ids: Sequence[int], n: int, streamer: BaseStreamer | None = None) -> torch.Tensor:
            x = torch.tensor([list(ids)], device=device)
            with torch.inference_mode():
                out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                     streamer=streamer, **kwargs)
            return out[0, x.shape[1]:]

        generate(prompt_token_ids[0], 2)  # warm-up: first-call allocations out of the timings
        results = []
        for pid, ids in zip(prompt_ids, prompt_token_ids):
            clock = _Clock()
            start = time.perf_counter()
            out = generate(ids, max_tokens, clock).tolist()
            results.append(_result(peer, pid, len(ids), out, start, clock.times[1:], clock.sizes[1:]))
        return results
    except Exception as e:  # a peer that cannot run is reported, not fatal to the benchmark
        return PeerSkip(peer, f"transformers failed: {type(e).__name__}: {e}")
    finally:
        torch.set_num_threads(old_threads)


class _ModelDraft:
    """A second GGUF model as llama-cpp-python's draft (the LlamaDraftModel interface:
    context ids in, draft ids out): its greedy `num_draft` tokens. Its generate() reuses
    its KV cache for the prefix shared with the previous call, so each call evaluates only
    the tokens new since then."""

    def __init__(self, llm, num_draft: int) -> None:
        self.llm, self.num_draft = llm, num_draft

    def __call__(self, input_ids: np.ndarray, /, **kwargs) -> np.ndarray:
        out: list[int] = []
        for token in self.llm.generate(input_ids.tolist(), top_k=1, temp=0.0, repeat_penalty=1.0):
            out.append(token)
            if len(out) == self.num_draft:
                break
        return np.array(out, dtype=np.intc)


def run_llamacpp(target_gguf: str | os.PathLike, prompt_token_ids: Sequence[Sequence[int]],
                 prompt_ids: Sequence[str], max_tokens: int, *, draft_gguf: str | os.PathLike | None = None,
                 prompt_lookup: bool = False, threads: int | None = None, ignore_eos: bool = False,
                 num_draft: int = 4) -> list[PeerResult] | PeerSkip:
    """Greedy decoding with llama-cpp-python on the GGUF file as it is (its own quantised
    kernels), batch 1.

    llama-cpp-python has no binding for llama.cpp's draft-model speculation; its only hook
    is `Llama(draft_model=LlamaDraftModel)`, a callable from the context to draft tokens
    that generate() verifies greedily. With `draft_gguf` ("llamacpp-spec") the hook runs a
    second Llama greedily for `num_draft` tokens; with `prompt_lookup` ("llamacpp-lookup")
    it is the package's LlamaPromptLookupDecoding (n-gram match in the context). Either
    makes the target compute logits for every position (logits_all), prompt included,
    which is part of what that path costs."""
    if draft_gguf is not None and prompt_lookup:
        raise ValueError("draft_gguf and prompt_lookup are exclusive")
    peer = "llamacpp-spec" if draft_gguf is not None else "llamacpp-lookup" if prompt_lookup else "llamacpp"
    _check(prompt_token_ids, prompt_ids, max_tokens)
    n_ctx = max(map(len, prompt_token_ids)) + max_tokens + 2 * num_draft + 8
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        def load(path: str | os.PathLike, **extra) -> Llama:
            threading = {} if threads is None else {"n_threads": threads, "n_threads_batch": threads}
            return Llama(model_path=str(path), n_ctx=n_ctx, n_gpu_layers=0, verbose=False, **threading, **extra)

        draft_llm = load(draft_gguf) if draft_gguf is not None else None
        draft_model = (_ModelDraft(draft_llm, num_draft) if draft_llm is not None
                       else LlamaPromptLookupDecoding(num_pred_tokens=num_draft) if prompt_lookup else None)
        # llama-cpp-python turns logits_all on for a draft model but sizes its logits buffer
        # from the argument (0.3.x), which then overflows past n_batch positions: say it.
        llm = load(target_gguf, draft_model=draft_model, logits_all=draft_model is not None)
        eos = llm.token_eos()

        def generate(ids: Sequence[int], n: int) -> tuple[list[int], list[float]]:
            for model in filter(None, (llm, draft_llm)):
                model.reset()  # no KV reuse between prompts: every prompt pays its prefill
            tokens, times = [], []
            for token in llm.generate(list(ids), top_k=1, temp=0.0, repeat_penalty=1.0):
                tokens.append(token)
                times.append(time.perf_counter())
                if len(tokens) == n or (token == eos and not ignore_eos):
                    break
            return tokens, times

        generate(prompt_token_ids[0], 2)  # warm-up
        results = []
        for pid, ids in zip(prompt_ids, prompt_token_ids):
            start = time.perf_counter()
            tokens, times = generate(ids, max_tokens)
            results.append(_result(peer, pid, len(ids), tokens, start, times, [1] * len(times)))
        return results
    except Exception as e:  # ImportError when the package is missing, ValueError when a file won't load
        return PeerSkip(peer, f"llama-cpp-python failed: {type(e).__name__}: {e}")
