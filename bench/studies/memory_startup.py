"""Resident memory and start-up of LLM(target, draft=..., mode="sd") on the default pair: time to
build the engine, time to the first token of one chat request, RSS against the GGUF files and
the KV caches it allocates.

    python bench/studies/memory_startup.py

Found (AMD EPYC Zen 4, 2 cores, 2026-11-29, files in the page cache): import 2.3 s, the engine
built in 4.8 s, the first request's first token 0.22 s after; RSS 2.06 GB against 1.61 GB of
GGUF files and 2.70 GB of KV caches (0.48 of both): the caches' pages are only touched as
tokens fill them. With the files read from disk cold, and a test suite running beside it, the
engine took 66 s to build.
"""
import os
import resource
import time
t0 = time.perf_counter()
import psutil
from ssd import LLM, SamplingParams
from ssd.store import gguf_path
t1 = time.perf_counter()
llm = LLM("qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct", mode="sd")
t2 = time.perf_counter()
out = llm.generate([[{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]],
                   SamplingParams.greedy(max_tokens=32))[0]
t3 = time.perf_counter()
kv = sum(t.numel() * t.element_size() for t in llm.engine.cache.kv) if isinstance(llm.engine.cache.kv, (list, tuple)) else llm.engine.cache.kv.numel() * llm.engine.cache.kv.element_size()
dkv = llm.engine.source.draft.engine.kv.kv
dkv = sum(t.numel() * t.element_size() for t in dkv) if isinstance(dkv, (list, tuple)) else dkv.numel() * dkv.element_size()
files = sum(os.path.getsize(gguf_path(m)) for m in ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"))
rss = psutil.Process().memory_info().rss
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(f"import {t1-t0:.1f} s, LLM(target, draft, sd) {t2-t1:.1f} s, first request ttft {out.metrics.ttft_s:.3f} s, total to 32 tokens {t3-t1:.1f} s")
print(f"GGUF files {files/1e9:.2f} GB, KV caches target {kv/1e9:.2f} GB + draft {dkv/1e9:.2f} GB")
print(f"RSS {rss/1e9:.2f} GB (peak {peak/1e9:.2f} GB); ratio RSS / (files + KV) = {rss/(files+kv+dkv):.2f}")
