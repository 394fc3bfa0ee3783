"""In-process A/B: one engine, prompt lookup beside the draft off/on alternated per prompt."""
import sys, time, json
from ssd import LLM, SamplingParams
from ssd.bench.prompts import load_prompt_set
from ssd.speculative.ngram import NgramSpeculator
sets, n, reps = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 1
res = {}
with LLM("qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct", mode="sd") as llm:
    pol = llm.engine.k_policy
    llm.generate("Count from one to ten.", SamplingParams.greedy(max_tokens=8))
    for name in sets:
        for p in load_prompt_set(name)[:n]:
            chat = [{"role": "user", "content": p.text}]
            outs = {}
            for r in range(reps):
                for lk in (("off", "on") if r % 2 == 0 else ("on", "off")):
                    pol.lookup = NgramSpeculator(1, 4) if lk == "on" else None
                    t = time.perf_counter()
                    o = llm.generate(chat, SamplingParams.greedy(max_tokens=128))[0]
                    wall = time.perf_counter() - t
                    m = o.metrics
                    res.setdefault((name, lk), []).append((m.decode_s, wall, len(o.token_ids), m.lookup_rounds))
                    outs[lk] = o.token_ids
            same = outs["on"] == outs["off"]
            print(name, p.id, {lk: [round(x[0], 2) for x in res[(name, lk)][-reps:]] for lk in ("off", "on")},
                  "lookups", res[(name, "on")][-1][3], "same" if same else "DIFFERENT", flush=True)
for name in sets:
    d = {lk: sum(x[0] for x in res[(name, lk)]) for lk in ("off", "on")}
    w = {lk: sum(x[1] for x in res[(name, lk)]) for lk in ("off", "on")}
    t = {lk: sum(x[2] - 1 for x in res[(name, lk)]) for lk in ("off", "on")}
    print(f"{name}: decode tok/s off {t['off']/d['off']:.1f} on {t['on']/d['on']:.1f} ({d['off']/d['on']*t['on']/t['off']:.3f}x); e2e off {w['off']:.1f}s on {w['on']:.1f}s")
