"""Suffix decoding where work repeats and where it does not: engines on one target side by side
in one process, taking turns request by request (the host's speed drifts), greedy, every
output checked token-identical to AR. Each engine keeps its own index and prefix cache, so
each learns from its own earlier requests (the same texts: the outputs are AR's).

Sets:
- humaneval-run: `--run` HumanEval problems answered one after another; decode tok/s over
  the last `--measure` (the index has the earlier answers by then).
- agent: `--tasks` tool-calling tasks, each its own conversation with the same system prompt
  and tools (bench/tool_calls.py's): the user asks for something, the model calls a tool,
  the tool's result goes back, the model answers (or calls again, once; then it is asked for
  the answer with tool_choice "none"); every request of a task counts, over the last half.
- mtbench: the first `--num-prompts` MT-Bench questions to fresh engines (nothing indexed
  but the request itself).

Configs: ar; sd (the draft, K auto, prompt lookup beside it: --lookup on); sd+suffix (suffix
decoding's chains beside the draft: --lookup suffix --siblings off); sd+suffix-tree (the
default: suffix decoding beside the draft, with its trees); suffix (draft="suffix" alone, with
its trees).

    python bench/suffix_decoding.py [--sets humaneval-run,agent,mtbench] [--run 40] [--measure 20]
        [--tasks 24] [--num-prompts 8] [--max-tokens 128] [--out FILE.json]
"""
import json
import sys
from pathlib import Path

from tool_calls import PROMPTS as ASKS, TOOLS  # bench/tool_calls.py, beside this script

from ssd import LLM, SamplingParams
from ssd.bench.prompts import load_prompt_set
from ssd.bench.report import machine_info
from ssd.bench.script_args import script_parser
from ssd.tools import Tools

SYSTEM = ("You are an assistant with tools. Call a tool when it helps. Once a tool has returned its result, "
          "answer the user from it in a sentence or two.")
TOOL_ROUNDS = 3  # requests a task makes at most: a call, a call again, the answer
# The asks again, each round about other things (a round repeated word for word would be
# copied whole from the index, which real traffic rarely is).
OTHER_VALUES = [dict(zip(("Lisbon", "Chicago", "250", "1200", "James Webb Space Telescope", "Zurich", "bob@example.com",
                          "3pm", "alice@example.org", "12", "45", "NVIDIA", "AAPL"), values))
                for values in [("Oslo", "Denver", "180", "5000", "Artemis program", "Innsbruck", "carol@example.net",
                                "4pm", "dave@example.com", "9", "30", "Intel", "MSFT"),
                               ("Hanoi", "Boston", "75", "900", "Rosetta mission", "Grenoble", "erin@example.org",
                                "11am", "frank@example.net", "20", "15", "AMD", "GOOG")]]


CONFIGS = {"ar": {}, "sd": {"mode": "sd", "prompt_lookup": True},
           "sd+suffix": {"mode": "sd", "prompt_lookup": "suffix", "draft_siblings": False},
           "sd+suffix-tree": {"mode": "sd"}, "suffix": {"mode": "sd", "draft": "suffix"}}


def engines(model: str, draft: str, configs: list[str]) -> dict[str, LLM]:
    """One engine per config; AR's first (the outputs are checked against it)."""
    out = {c: LLM(model, **({"draft": draft} if c.startswith("sd") else {}) | CONFIGS[c])
           for c in ["ar"] + [c for c in configs if c != "ar"]}
    for llm in out.values():  # first calls' allocations out of the timings
        llm.generate(["Hello"], SamplingParams.greedy(max_tokens=8))
    return out


class Totals:
    """Per config, over a set's measured requests: decode tokens and seconds, drafted,
    accepted; and every request's text as the target read it (`requests`: for a peer), with
    the engines that served it (`group`: sets served by the same engines share their index)."""

    def __init__(self, name: str, labels, group: int):
        self.name, self.group = name, group
        self.t = {label: [0, 0.0, 0, 0] for label in labels}
        self.requests: list[dict] = []

    def add(self, label: str, out) -> None:
        m, t = out.metrics, self.t[label]
        t[0] += max(0, m.output_tokens - 1)
        t[1] += m.decode_s
        t[2] += m.drafted
        t[3] += m.accepted

    def rows(self) -> list[dict]:
        name = self.name
        speed = {label: t[0] / t[1] if t[1] else None for label, t in self.t.items()}

        def ratio(a: float | None, b: float | None) -> float | None:
            return round(a / b, 2) if a and b else None
        out = [{"set": name, "config": label, "tok_s": round(speed[label], 1) if speed[label] else None,
                "vs_ar": ratio(speed[label], speed["ar"]), "vs_sd": ratio(speed[label], speed.get("sd")),
                "acceptance": round(t[3] / t[2], 3) if t[2] else None, "tokens": t[0]}
               for label, t in self.t.items()]
        for r in out:
            print(f"{r['set']:14} {r['config']:10} {r['tok_s'] or '-':>6} {r['vs_ar'] or '-':>5} "
                  f"{r['vs_sd'] or '-':>5} {r['acceptance'] if r['acceptance'] is not None else '-':>7} "
                  f"{r['tokens']:6}", flush=True)
        return out


def turn(llms: dict[str, LLM], prompt, params: SamplingParams, totals: Totals, measured: bool, i: int, tools=None):
    """One request to every engine, starting with a different one each time; returns AR's output."""
    totals.requests.append({"set": totals.name, "group": totals.group, "text": llms["ar"].render(prompt, tools),
                            "measured": measured})
    labels = list(llms)
    outs = {}
    for label in labels[i % len(labels):] + labels[:i % len(labels)]:
        outs[label] = llms[label].generate([prompt], params, tools=tools)[0]
    wrong = [label for label, o in outs.items() if o.token_ids != outs["ar"].token_ids]
    if wrong:
        sys.exit(f"{', '.join(wrong)} differ from AR at request {i}")
    if measured:
        for label, o in outs.items():
            totals.add(label, o)
    return outs["ar"]


def humaneval_run(llms, params, run: int, measure: int) -> Totals:
    totals = Totals("humaneval-run", llms, 0)
    for i, p in enumerate(load_prompt_set("humaneval", run)):
        turn(llms, [{"role": "user", "content": p.text}], params, totals, i >= run - measure, i)
    return totals


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


def assistant_message(out) -> dict:
    """The model's answer as the next request's history holds it: its text or its calls."""
    calls = out.tool_calls or []
    if not calls:
        return {"role": "assistant", "content": out.text}
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in calls]}


def agent(llms, params, tasks: int) -> Totals:
    """`tasks` tasks as an agent runs them, each a conversation of its own with the same
    system prompt and tools: the user's ask, then while the model calls tools their results
    go back, up to TOOL_ROUNDS requests; the last one asks for the answer (tool_choice "none"),
    as an agent does that stops a model calling again and again. (In one long conversation the
    1.5B target stopped calling tools after the first exchange: it answered from earlier
    results or said it could not.)"""
    totals = Totals("agent", llms, 0)
    offered, answer = Tools.check(TOOLS), Tools.check(TOOLS, choice="none")
    request = 0
    for t in range(tasks):
        ask, _ = ASKS[t % len(ASKS)]
        for old, new in (OTHER_VALUES[(t // len(ASKS) - 1) % len(OTHER_VALUES)] if t >= len(ASKS) else {}).items():
            ask = ask.replace(old, new)  # the same kinds of request again, about other things
        chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ask}]
        for r in range(TOOL_ROUNDS):
            out = turn(llms, chat, params, totals, t >= tasks // 2, request,
                       tools=offered if r < TOOL_ROUNDS - 1 else answer)
            request += 1
            chat.append(assistant_message(out))
            if not out.tool_calls:
                break
            for c in out.tool_calls:
                chat.append({"role": "tool", "tool_call_id": c.id, "content": tool_result(c)})
    return totals


def mtbench(model, draft, configs, params, n: int) -> Totals:
    llms = engines(model, draft, configs)  # fresh: nothing indexed
    totals = Totals("mtbench", llms, 1)
    for i, p in enumerate(load_prompt_set("mtbench", n)):
        turn(llms, [{"role": "user", "content": p.text}], params, totals, True, i)
    for llm in llms.values():
        llm.close()
    return totals


def main() -> None:
    ap = script_parser(__doc__, draft=True, sets="humaneval-run,agent,mtbench", num_prompts=8, max_tokens=128,
                       out=True)
    ap.add_argument("--run", type=int, default=40)
    ap.add_argument("--measure", type=int, default=20)
    ap.add_argument("--tasks", type=int, default=24)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="of " + ", ".join(CONFIGS) + " (ar always runs)")
    ap.add_argument("--requests-out", type=Path, help="every request's text as the target read it, in order, a "
                    "JSON line each (set, group, text, measured): what bench/llamacpp_spec.py --requests replays")
    args = ap.parse_args()
    params = SamplingParams.greedy(max_tokens=args.max_tokens)
    sets, configs = args.sets.split(","), args.configs.split(",")
    if not set(configs) <= set(CONFIGS):
        ap.error(f"--configs takes {', '.join(CONFIGS)}")
    print(f"{'set':14} {'config':10} {'tok/s':>6} {'x AR':>5} {'x SD':>5} {'accept':>7} {'tokens':>6}", flush=True)
    rows, requests = [], []

    def done(totals: Totals) -> None:  # as each set ends: a later set's failure loses nothing
        rows.extend(totals.rows())
        requests.extend(totals.requests)
    if "humaneval-run" in sets or "agent" in sets:
        llms = engines(args.model, args.draft, configs)
        if "humaneval-run" in sets:
            done(humaneval_run(llms, params, args.run, args.measure))
        if "agent" in sets:
            done(agent(llms, params, args.tasks))
        for llm in llms.values():
            llm.close()
    if "mtbench" in sets:
        done(mtbench(args.model, args.draft, configs, params, args.num_prompts))
    if args.requests_out:
        args.requests_out.write_text("".join(json.dumps(r) + "\n" for r in requests))
    if args.out:
        args.out.write_text(json.dumps({"machine": machine_info(), "args": {k: str(v) if isinstance(v, Path) else v
                                                                            for k, v in vars(args).items()},
                                        "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
