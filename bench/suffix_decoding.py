"""Suffix decoding where work repeats and where it does not: engines on one target side by side
in one process, taking turns request by request (the host's speed drifts), greedy, every
output checked token-identical to AR. Each engine keeps its own index and prefix cache, so
each learns from its own earlier requests (the same texts: the outputs are AR's).

Sets:
- humaneval-run: `--run` HumanEval problems answered one after another; decode tok/s over
  the last `--measure` (the index has the earlier answers by then).
- agent: a tool-calling loop of `--turns` turns in one conversation: the user asks for
  something, the model calls a tool (the tools of bench/tool_calls.py), the tool's result
  goes back, the model answers; both requests of each turn count, over the last half.
- mtbench: the first `--num-prompts` MT-Bench questions to fresh engines (nothing indexed
  but the request itself).

Configs: ar; sd (the draft, K auto, its default n-gram lookup beside it); sd+suffix (the
same with suffix decoding beside the draft, --lookup suffix); suffix (draft="suffix" alone).

    python bench/suffix_decoding.py [--sets humaneval-run,agent,mtbench] [--run 40] [--measure 20]
        [--turns 12] [--num-prompts 8] [--max-tokens 128] [--out FILE.json]
"""
import argparse
import json
import sys
from pathlib import Path

from ssd import LLM, SamplingParams
from ssd.bench.prompts import load_prompt_set
from ssd.bench.report import machine_info

sys.path.insert(0, str(Path(__file__).parent))
from tool_calls import PROMPTS as ASKS, TOOLS  # noqa: E402

CITIES = ["Oslo", "Lima", "Cairo", "Hanoi", "Quito", "Perth", "Dakar", "Riga", "Minsk", "Tunis", "Porto", "Accra"]


def engines(model: str, draft: str) -> dict[str, LLM]:
    out = {"ar": LLM(model), "sd": LLM(model, draft=draft, mode="sd"),
           "sd+suffix": LLM(model, draft=draft, mode="sd", prompt_lookup="suffix"),
           "suffix": LLM(model, draft="suffix", mode="sd")}
    for llm in out.values():  # first calls' allocations out of the timings
        llm.generate(["Hello"], SamplingParams.greedy(max_tokens=8))
    return out


class Totals:
    """Per config, over the measured requests: decode tokens and seconds, drafted, accepted."""

    def __init__(self, labels):
        self.t = {label: [0, 0.0, 0, 0] for label in labels}

    def add(self, label: str, out) -> None:
        m, t = out.metrics, self.t[label]
        t[0] += max(0, m.output_tokens - 1)
        t[1] += m.decode_s
        t[2] += m.drafted
        t[3] += m.accepted

    def rows(self, name: str) -> list[dict]:
        speed = {label: t[0] / t[1] if t[1] else None for label, t in self.t.items()}

        def ratio(a: float | None, b: float | None) -> float | None:
            return round(a / b, 2) if a and b else None
        out = [{"set": name, "config": label, "tok_s": round(speed[label], 1) if speed[label] else None,
                "vs_ar": ratio(speed[label], speed["ar"]), "vs_sd": ratio(speed[label], speed["sd"]),
                "acceptance": round(t[3] / t[2], 3) if t[2] else None, "tokens": t[0]}
               for label, t in self.t.items()]
        for r in out:  # as each set ends: a later set's failure loses nothing
            print(f"{r['set']:14} {r['config']:10} {r['tok_s'] or '-':>6} {r['vs_ar'] or '-':>5} {r['vs_sd'] or '-':>5} "
                  f"{r['acceptance'] if r['acceptance'] is not None else '-':>7} {r['tokens']:6}", flush=True)
        return out


def turn(llms: dict[str, LLM], prompt, params: SamplingParams, totals: Totals | None, i: int, tools=None):
    """One request to every engine, starting with a different one each time; returns AR's output."""
    labels = list(llms)
    outs = {}
    for label in labels[i % len(labels):] + labels[:i % len(labels)]:
        outs[label] = llms[label].generate([prompt], params, tools=tools)[0]
    wrong = [label for label, o in outs.items() if o.token_ids != outs["ar"].token_ids]
    if wrong:
        sys.exit(f"{', '.join(wrong)} differ from AR at request {i}")
    if totals is not None:
        for label, o in outs.items():
            totals.add(label, o)
    return outs["ar"]


def humaneval_run(llms, params, run: int, measure: int) -> list[dict]:
    totals = Totals(llms)
    for i, p in enumerate(load_prompt_set("humaneval", run)):
        turn(llms, [{"role": "user", "content": p.text}], params, totals if i >= run - measure else None, i)
    return totals.rows("humaneval-run")


def tool_result(call) -> str:
    """A fixed, plausible result for each tool."""
    args = json.loads(call.arguments)
    if call.name == "get_weather":
        return json.dumps({"city": args.get("city"), "temperature": 14, "unit": args.get("unit", "celsius"),
                           "conditions": "cloudy", "wind_kmh": 11})
    if call.name == "convert_currency":
        return json.dumps({"amount": args.get("amount"), "from": args.get("from"), "to": args.get("to"),
                           "result": round(float(args.get("amount", 1)) * 0.92, 2)})
    if call.name == "search_web":
        return json.dumps({"results": [{"title": f"Result {i} for {args.get('query')}", "url": f"https://example.com/{i}"}
                                       for i in range(1, 4)]})
    return json.dumps({"ok": True, "tool": call.name})


def agent(llms, params, turns: int) -> list[dict]:
    totals = Totals(llms)
    chat = [{"role": "system", "content": "You are an assistant with tools. Call a tool when it helps."}]
    for t in range(turns):
        ask, _ = ASKS[t % len(ASKS)]
        if t >= len(ASKS):  # the same kinds of requests again, about another city or amount
            ask = ask.replace("Lisbon", CITIES[t % len(CITIES)]).replace("250", str(100 + 10 * t))
        chat.append({"role": "user", "content": ask})
        counted = totals if t >= turns // 2 else None
        out = turn(llms, chat, params, counted, 2 * t, tools=TOOLS)
        calls = out.tool_calls or []
        chat.append({"role": "assistant", "content": out.text if not calls else None,
                     "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                                  "arguments": c.arguments}}
                                    for c in calls] or None})
        if not calls:
            continue
        for c in calls:
            chat.append({"role": "tool", "tool_call_id": c.id, "content": tool_result(c)})
        out = turn(llms, chat, params, counted, 2 * t + 1, tools=TOOLS)
        chat.append({"role": "assistant", "content": out.text})
    return totals.rows("agent")


def mtbench(model, draft, params, n: int) -> list[dict]:
    llms = engines(model, draft)  # fresh: nothing indexed
    totals = Totals(llms)
    for i, p in enumerate(load_prompt_set("mtbench", n)):
        turn(llms, [{"role": "user", "content": p.text}], params, totals, i)
    for llm in llms.values():
        llm.close()
    return totals.rows("mtbench")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--sets", default="humaneval-run,agent,mtbench")
    ap.add_argument("--run", type=int, default=40)
    ap.add_argument("--measure", type=int, default=20)
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    params = SamplingParams.greedy(max_tokens=args.max_tokens)
    sets = args.sets.split(",")
    print(f"{'set':14} {'config':10} {'tok/s':>6} {'x AR':>5} {'x SD':>5} {'accept':>7} {'tokens':>6}", flush=True)
    rows = []
    if "humaneval-run" in sets or "agent" in sets:
        llms = engines(args.model, args.draft)
        if "humaneval-run" in sets:
            rows += humaneval_run(llms, params, args.run, args.measure)
        if "agent" in sets:
            rows += agent(llms, params, args.turns)
        for llm in llms.values():
            llm.close()
    if "mtbench" in sets:
        rows += mtbench(args.model, args.draft, params, args.num_prompts)
    if args.out:
        args.out.write_text(json.dumps({"machine": machine_info(), "args": vars(args) | {"out": str(args.out)},
                                        "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
