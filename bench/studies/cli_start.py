"""How long the `ssd` command takes to answer before any model loads: `ssd --help`,
`ssd serve --help` and `ssd models` (none of them imports torch), against importing torch
alone, on this machine. Median of N runs each, in turns.

    python bench/studies/cli_start.py [--runs 5]

Found (AMD EPYC Zen 4, 2 cores, 2026-11-29, 5 runs): `ssd --help` 0.10 s, `ssd serve --help`
0.11 s, `ssd models` 0.11 s, against 1.43 s to import torch: the commands that load no model
answer before torch could even be imported (tests/test_cli.py keeps them from importing it).
"""
import argparse
import shutil
import statistics
import subprocess
import sys
import time

COMMANDS = {"ssd --help": ["--help"], "ssd serve --help": ["serve", "--help"], "ssd models": ["models"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    ssd = shutil.which("ssd") or sys.exit("the `ssd` command is not on PATH (pip install -e .)")
    runs = {name: [] for name in [*COMMANDS, "python -c 'import torch'"]}
    for _ in range(args.runs):
        for name in runs:
            cmd = [ssd, *COMMANDS[name]] if name in COMMANDS else [sys.executable, "-c", "import torch"]
            start = time.perf_counter()
            subprocess.run(cmd, stdout=subprocess.DEVNULL, check=True)
            runs[name].append(time.perf_counter() - start)
    for name, times in runs.items():
        print(f"{name:28} median {statistics.median(times):.2f} s  (min {min(times):.2f}, max {max(times):.2f})")


if __name__ == "__main__":
    main()
