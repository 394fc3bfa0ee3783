"""The draft sources that need no draft model, by the name `draft=` takes (`--draft NAME`);
any other `draft` is a draft model (SD: draft_model.py; SSD: ssd_worker.py). They run in
mode "sd", and every option that a draft model's rounds read applies to none of them."""
from collections.abc import Callable

from ssd.speculative.options import NGRAM, SUFFIX, SpecOptions
from ssd.speculative.sources.base import DraftSource
from ssd.speculative.sources.ngram import PromptLookup
from ssd.speculative.sources.suffix import SuffixIndex, SuffixLookup

NAMED: dict[str, Callable[[SpecOptions], DraftSource]] = {
    NGRAM: lambda opts: PromptLookup(opts.ngram_min, opts.ngram_max),
    SUFFIX: lambda opts: SuffixLookup(SuffixIndex(opts.suffix_tokens)),
}
