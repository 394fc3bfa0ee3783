"""Where a speculative round's time goes, per configuration of an `ssd bench` run, and SSD's
bound against SD (docs/algorithm.md): a round of SD costs K d + V (d: a draft step, V: the
target's verify pass) and one of SSD on a cache hit only V, so SSD can be at most about
1 + K d / V times SD's speed with the same draft and acceptance.

    python bench/round_costs.py OUT/results.json [--sd CONFIG]

Prints per configuration: rounds, draft tokens a round, d (the draft's wait per drafted token),
V (the verify pass), the draft's wait a round, SSD's hit rate and the worker's idle share, and
for each SSD configuration its speed over the SD configuration named (default: the fastest)
beside the bound from that SD's d and V at the SSD's K.
"""
import argparse
import json
from pathlib import Path


def costs(records: list[dict]) -> dict:
    """Summed over a configuration's records (every prompt, every set)."""
    total = {k: sum(r["metrics"].get(k) or 0 for r in records)
             for k in ("rounds", "drafted", "draft_s", "verify_s", "hits", "misses", "draft_idle_s", "tree_s",
                       "output_tokens", "decode_s")}
    n = max(total["rounds"], 1)
    return {"rounds": total["rounds"], "k": total["drafted"] / n,
            "d_ms": 1e3 * total["draft_s"] / max(total["drafted"], 1), "v_ms": 1e3 * total["verify_s"] / n,
            "wait_ms": 1e3 * total["draft_s"] / n,
            "hit": total["hits"] / max(total["hits"] + total["misses"], 1) if total["hits"] + total["misses"] else None,
            "tok_s": total["output_tokens"] / max(total["decode_s"], 1e-9)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--sd", help="the SD configuration SSD is held against (default: the fastest SD)")
    args = ap.parse_args()
    res = json.loads(args.results.read_text())
    modes = {c["label"]: c["mode"] for c in res["config"]["configs"]}
    rows = {label: costs([r for r in res["records"] if r["config"] == label]) for label in modes}
    print(f"{'config':<24} {'rounds':>6} {'K':>5} {'d ms':>7} {'V ms':>7} {'wait ms':>8} {'hit':>5} {'tok/s':>7}")
    for label, c in rows.items():
        hit = "-" if c["hit"] is None else f"{c['hit']:.0%}"
        print(f"{label:<24} {c['rounds']:>6} {c['k']:>5.2f} {c['d_ms']:>7.3f} {c['v_ms']:>7.2f} {c['wait_ms']:>8.3f} "
              f"{hit:>5} {c['tok_s']:>7.1f}")
    sds = [label for label, mode in modes.items() if mode == "sd"]
    sd = args.sd or max(sds, key=lambda label: rows[label]["tok_s"], default=None)
    if sd is None:
        return
    for label in (label for label, mode in modes.items() if mode == "ssd"):
        k = rows[label]["k"]
        bound = 1 + k * rows[sd]["d_ms"] / rows[sd]["v_ms"]
        print(f"{label} over {sd}: {rows[label]['tok_s'] / rows[sd]['tok_s']:.2f}x "
              f"(bound 1 + K d / V = 1 + {k:.2f} x {rows[sd]['d_ms']:.3f} / {rows[sd]['v_ms']:.2f} = {bound:.2f}x)")


if __name__ == "__main__":
    main()
