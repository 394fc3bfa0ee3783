"""ssd-engine: exact accelerated LLM decoding (AR, speculative, speculative speculative)."""
from ssd.errors import SSDError
from ssd.outputs import RequestOutput, StreamChunk
from ssd.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "StreamChunk", "SSDError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # `ssd.LLM` loads the engine (torch, transformers) on first use, so that `import ssd.cli`
    # answers `ssd --help` in a fraction of a second.
    if name == "LLM":
        from ssd.llm import LLM
        return LLM
    raise AttributeError(f"module 'ssd' has no attribute {name!r}")
