"""The options the scripts in bench/ share (--model, --draft, --sets, --num-prompts, --max-tokens,
--threads, --out), each spelled once: a script asks for the ones it takes, with its own defaults,
then adds its own. `ssd bench` has its own options, in ssd/bench/cli.py."""
import argparse
from pathlib import Path

from ssd.store import DEFAULT_DRAFT, DEFAULT_TARGET


def script_parser(doc: str | None, *, whole_doc: bool = False, model: str | None = DEFAULT_TARGET,
                  draft: bool = False, sets: str | None = None, num_prompts: int | None = None,
                  max_tokens: int | None = None, threads: int | None | bool = False,
                  out: bool = False) -> argparse.ArgumentParser:
    """A script's parser: its description the first paragraph of `doc` (whole_doc: all of it, as
    written), with the shared options asked for. model=None, draft/out False, threads False and
    the others None leave that option out; threads=None adds it with the engine's default."""
    if whole_doc:
        ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    else:
        ap = argparse.ArgumentParser(description=doc.split("\n\n")[0] if doc else None)
    if model is not None:
        ap.add_argument("--model", default=model,
                        help="the target: a store name, a model folder or a .gguf file (default: %(default)s)")
    if draft:
        ap.add_argument("--draft", default=DEFAULT_DRAFT, help="the draft model, same forms (default: %(default)s)")
    if sets is not None:
        ap.add_argument("--sets", default=sets, help="prompt sets, comma-separated (default: %(default)s)")
    if num_prompts is not None:
        ap.add_argument("--num-prompts", type=int, default=num_prompts, help="prompts per set (default: %(default)s)")
    if max_tokens is not None:
        ap.add_argument("--max-tokens", type=int, default=max_tokens,
                        help="most tokens per answer (default: %(default)s)")
    if threads is not False:
        ap.add_argument("--threads", type=int, default=threads,
                        help="CPU threads (default: " + ("the engine's" if threads is None else "%(default)s") + ")")
    if out:
        ap.add_argument("--out", type=Path, help="where the results go")
    return ap
