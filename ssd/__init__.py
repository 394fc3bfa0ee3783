"""ssd-engine: exact accelerated LLM decoding (AR, speculative, speculative speculative)."""
from ssd.llm import LLM
from ssd.errors import SSDError
from ssd.outputs import RequestOutput, StreamChunk
from ssd.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "StreamChunk", "SSDError"]
__version__ = "0.1.0"
