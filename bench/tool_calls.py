"""Tool calls on prompts that ask for one: whether every call the model writes is parsed, and
whether the arguments validate against the function's parameter schema, with tool_choice
"auto" (the model decides; its text is only parsed), "required" (a grammar over the model's
call format and the parameter schemas enforces one call or more) and "required-one" (the
same with parallel_tool_calls false: one call), in AR and SD, greedy.

    python bench/tool_calls.py --modes ar,sd --threads 2 --out bench-out/tools

Per mode and choice: prompts, calls emitted (the call marker or a bare {"name", "arguments"}
answer in the raw output), calls parsed, arguments valid, the expected function called,
finish_reason "tool_calls", decode tok/s, and whether SD's tokens equal AR's.
"""
import json
import sys

import jsonschema

from ssd import LLM, SamplingParams
from ssd.bench.report import machine_info
from ssd.bench.script_args import script_parser
from ssd.tools import OPEN, Tools

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"], "properties": {
            "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {
        "name": "convert_currency", "description": "Convert an amount of money between currencies",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["amount", "from", "to"],
                       "properties": {"amount": {"type": "number"}, "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                      "to": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}},
    {"type": "function", "function": {
        "name": "search_web", "description": "Search the web and return the top results",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["query"], "properties": {
            "query": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1, "maximum": 10}}}}},
    {"type": "function", "function": {
        "name": "send_email", "description": "Send an email",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["to", "subject", "body"],
                       "properties": {"to": {"type": "string"}, "subject": {"type": "string"},
                                      "body": {"type": "string"}}}}},
    {"type": "function", "function": {
        "name": "set_timer", "description": "Start a countdown timer",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["minutes"], "properties": {
            "minutes": {"type": "integer", "minimum": 1}, "label": {"type": "string"}}}}},
    {"type": "function", "function": {
        "name": "get_stock_price", "description": "The latest price of a stock",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["symbol"], "properties": {
            "symbol": {"type": "string"}}}}},
]

# (user message, the function it should call)
PROMPTS = [
    ("What's the weather like in Lisbon right now, in celsius?", "get_weather"),
    ("Is it warm in Chicago today? Give me fahrenheit.", "get_weather"),
    ("How much is 250 US dollars in euros?", "convert_currency"),
    ("Convert 1200 Japanese yen to British pounds.", "convert_currency"),
    ("Find recent news about the James Webb Space Telescope.", "search_web"),
    ("Search the web for the best hiking trails near Zurich, 5 results.", "search_web"),
    ("Email bob@example.com that the meeting moved to 3pm, subject 'Meeting time'.", "send_email"),
    ("Send an email to alice@example.org thanking her for the report.", "send_email"),
    ("Set a timer for 12 minutes for the pasta.", "set_timer"),
    ("Remind me in 45 minutes with a timer labelled 'call mom'.", "set_timer"),
    ("What is NVIDIA's stock trading at?", "get_stock_price"),
    ("Look up the current share price of AAPL.", "get_stock_price"),
]


def check(out, name: str) -> dict:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    calls = out.tool_calls or []
    valid = 0
    for c in calls:
        try:
            jsonschema.validate(json.loads(c.arguments), schemas[c.name])
            valid += 1
        except (KeyError, json.JSONDecodeError, jsonschema.ValidationError):
            pass
    return {"calls": len(calls), "valid": valid, "right_name": any(c.name == name for c in calls),
            "finish_reason": out.finish_reason}


def main() -> None:
    ap = script_parser(__doc__, draft=True, max_tokens=160, threads=2, out=True)
    ap.add_argument("--modes", default="ar,sd")
    ap.add_argument("--choices", default="auto,required,required-one")
    args = ap.parse_args()
    params = SamplingParams.greedy(max_tokens=args.max_tokens)
    rows, records, reference = [], [], {}
    for mode in args.modes.split(","):
        kw = {} if mode == "ar" else {"draft": args.draft}
        with LLM(args.model, mode=mode, threads=args.threads, **kw) as llm:
            llm.generate([[{"role": "user", "content": "Hi"}]], SamplingParams.greedy(max_tokens=4))  # warm-up
            for choice in args.choices.split(","):
                # "required-one": required with parallel_tool_calls false (one call, then the end)
                tools = Tools.check(TOOLS, choice.removesuffix("-one"), parallel=not choice.endswith("-one"))
                emitted = parsed = valid = right = finished = 0
                tokens = seconds = same = 0
                for i, (text, name) in enumerate(PROMPTS):
                    out = llm.generate([[{"role": "user", "content": text}]], params, tools=tools)[0]
                    raw = llm.tokenizer.decode(out.token_ids, skip_special_tokens=False)
                    c = check(out, name)
                    wrote = OPEN in raw or bool(c["calls"])
                    emitted += wrote
                    parsed += wrote and c["calls"] > 0
                    valid += c["calls"] > 0 and c["valid"] == c["calls"]
                    right += c["right_name"]
                    finished += out.finish_reason == "tool_calls"
                    tokens += out.metrics.output_tokens - 1  # decode_s runs first token to last
                    seconds += out.metrics.decode_s
                    key = (choice, i)
                    if mode == "ar":
                        reference[key] = out.token_ids
                    same += reference.get(key) == out.token_ids
                    records.append({"mode": mode, "choice": choice, "prompt": text, "expected": name, "raw": raw,
                                    "tool_calls": [vars(t) for t in out.tool_calls or []],
                                    "finish_reason": out.finish_reason, "metrics": out.metrics.as_dict()})
                n = len(PROMPTS)
                rows.append([mode, choice, str(n), str(emitted), f"{parsed}/{emitted}", f"{valid}/{n}", f"{right}/{n}",
                             f"{finished}/{n}", f"{tokens / seconds:.1f}", "-" if mode == "ar" else f"{same}/{n}"])
                print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    head = ["mode", "tool_choice", "prompts", "calls written", "parsed", "valid arguments", "expected function",
            "finish tool_calls", "decode tok/s", "=AR"]
    table = "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows])
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "table.md").write_text(table + "\n")
        (args.out / "results.json").write_text(json.dumps({"machine": machine_info(), "args": vars(args) | {"out": str(args.out)},
                                                           "rows": rows, "records": records}, indent=1, default=str))


if __name__ == "__main__":
    main()
