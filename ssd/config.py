"""The engine's configuration: what LLM(...) is asked for, checked once, before any model
loads or worker starts, and resolved against this machine and the model (its folder, device,
dtype, weights, context). The draft side's configuration derives from it
(ssd/engine/llm_engine.py)."""
import os
from dataclasses import dataclass, field, fields

import torch

from ssd.checks import check_int, is_int, is_number
from ssd.distributed.link import parse_address
from ssd.distributed.placement import default_dtype, engine_threads, parse_placement
from ssd.distributed.tensor_parallel import RANK_SECRET_ENV
from ssd.errors import SSDError
from ssd.models.config import ModelConfig
from ssd.models.loader import resolve_weights
from ssd.models.shard import plan
from ssd.request.noise import SEEDED_SAMPLING
from ssd.speculative.draft.eagle import is_eagle_head
from ssd.speculative.options import SpecOptions
from ssd.speculative.sources.named import NAMED
from ssd.store import resolve_model

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
MIN_CACHE_TOKENS = 16384  # the default KV cache holds at least this many tokens


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except RuntimeError as e:
        raise SSDError(f"device {device!r}: {e}") from None
    if device.type not in ("cpu", "cuda"):
        # Apple's GPU among them: its kernels are not written, and a silent fallback to plain
        # torch ops there would lose the batch invariance exactness rests on (docs/kernels.md).
        raise SSDError(f"device {str(device)!r}: this engine runs on the CPU and on CUDA GPUs"
                       + ("; on Apple Silicon use device='cpu' (the NEON kernels)" if device.type == "mps" else ""))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SSDError("device cuda was asked for but this machine has no usable CUDA GPU")
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return default_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise SSDError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


@dataclass
class EngineConfig:
    """LLM(...)'s options (docs/usage.md, "Python API"). As given, then resolved in place: `model`
    becomes the model's folder, `device`, `dtype` and `weights` what they are here,
    `max_model_len`, `threads` and `kv_cache_tokens` numbers, and `speculation` the checked
    options of the mode (its K filled in)."""

    model: str | os.PathLike
    draft: str | os.PathLike | None = None  # a model, or "ngram" (prompt lookup)
    mode: str = "ar"
    device: str | torch.device | None = None
    dtype: str | torch.dtype | None = None
    max_model_len: int | None = None
    threads: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    kv_cache_tokens: int | None = None
    block_size: int = 16
    seed: int | None = None
    # How seeded sampled requests draw (ssd/request/noise.py): "shared-noise" or "rejection".
    seeded_sampling: str = "shared-noise"
    weights: str = "auto"
    enable_prefix_caching: bool = True  # full blocks of shared prompt prefixes computed once (kv_cache.py)
    # On CUDA, the target's passes of up to this many tokens run as one CUDA graph padded to this
    # many rows (engine/cuda_graphs.py); 0: eager. One row count keeps SD/SSD == AR while a pass
    # holds no more tokens (batch x (K + 1)).
    cuda_graph_rows: int = 16
    # The target's layers split across this many processes (engine/tensor_parallel.py; CPU,
    # unquantized weights); `threads` is then each rank's share of the threads.
    tensor_parallel_size: int = 1
    # HOST:PORT where rank 0 waits for ranks started by hand (`ssd rank`), with the secret of
    # $SSD_RANK_SECRET; None starts them on this machine.
    tensor_parallel_address: str | None = None
    tensor_parallel_timeout: float = 60.0  # seconds a rank may keep the others waiting before it counts as hung
    speculation: SpecOptions = field(default_factory=SpecOptions)
    model_config: ModelConfig = field(init=False, repr=False)
    # Whether each model's passes choose their thread count, up to `threads`, by the machine's
    # load (ssd/runner/threads.py): on a CPU, one process, threads not given.
    follow_load: bool = field(init=False, repr=False, default=False)

    def __post_init__(self) -> None:
        spec = self.speculation = self.speculation.resolved(self.mode, self.draft in NAMED)
        if (self.draft is None) != (self.mode == "ar"):
            raise SSDError(f"mode {self.mode!r} needs a draft model" if self.draft is None
                           else f"a draft model needs mode 'sd' or 'ssd', not {self.mode!r}")
        if self.draft in NAMED and self.mode != "sd":
            raise SSDError(f"draft='{self.draft}' (a draft source without a model) runs in mode 'sd', "
                           f"not {self.mode!r}")
        if self.threads is not None:
            check_int("threads", self.threads, 1)
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            check_int(name, getattr(self, name), 1)
        check_int("cuda_graph_rows", self.cuda_graph_rows, 0, 1024)
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1, 64)
        if not (is_number(self.tensor_parallel_timeout) and self.tensor_parallel_timeout > 0):
            raise SSDError(f"tensor_parallel_timeout must be > 0 seconds, got {self.tensor_parallel_timeout!r}")
        if self.tensor_parallel_address is not None and self.tensor_parallel_size == 1:
            raise SSDError("tensor_parallel_address needs tensor_parallel_size > 1")
        if self.kv_cache_tokens is not None:
            check_int("kv_cache_tokens", self.kv_cache_tokens, 1)
        if self.seed is not None:
            check_int("seed", self.seed, 0, 2**64 - 1)
        if self.seeded_sampling not in SEEDED_SAMPLING:
            raise SSDError(f"seeded_sampling must be one of {', '.join(SEEDED_SAMPLING)}, got {self.seeded_sampling!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise SSDError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        # SSD pins the target to its cores around each step (the draft source's placement()).
        given = self.threads is not None
        self.threads = engine_threads(self.threads)
        target_device = spec.target_device if self.mode == "ssd" else None
        self.device = resolve_device(self.device if target_device is None else parse_placement(target_device).device)
        self.dtype = resolve_dtype(self.dtype, self.device)
        # (SSD pins the target and its worker to cores of their own: their counts stay.)
        self.follow_load = not given and self.device.type == "cpu" and self.tensor_parallel_size == 1 \
            and self.mode != "ssd"
        self.model = resolve_model(self.model)
        self.model_config = ModelConfig.from_folder(self.model)
        if self.draft is not None and self.draft not in NAMED and is_eagle_head(resolve_model(self.draft)):
            self._check_feature_head()
        if self.tensor_parallel_size > 1:
            self._check_tensor_parallel()
        self.weights = resolve_weights(self.model, self.device, self.weights)  # fail now, before a worker starts
        limit = self.model_config.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = limit
        elif not (is_int(self.max_model_len) and 1 < self.max_model_len <= limit):
            raise SSDError(f"max_model_len must be in 2..{limit} for this model, got {self.max_model_len}")
        self.kv_cache_tokens = self.kv_cache_tokens or max(self.max_model_len, MIN_CACHE_TOKENS)

    def _check_feature_head(self) -> None:
        """What an EAGLE-3 head as the draft (ssd/speculative/draft/eagle.py) runs with."""
        quantization = self.speculation.draft_quantization
        if self.mode != "sd" or self.tensor_parallel_size > 1:
            raise SSDError("an EAGLE-3 head drafts in mode 'sd', without tensor parallelism, so far")
        if quantization in ("gguf", "q4_0") or self.device.type != "cpu" and quantization == "int8":
            raise SSDError(f"draft_quantization={quantization!r} is not for this draft: an EAGLE-3 head's weights "
                           "are int8 ('auto' or 'int8' on the CPU) or fp32 (None), on a GPU in the target's dtype "
                           "('auto' or None)")

    def _check_tensor_parallel(self) -> None:
        n = self.tensor_parallel_size
        if self.device.type != "cpu":
            raise SSDError(f"tensor_parallel_size={n} runs on the CPU (gloo) so far, not on {self.device.type}")
        if self.weights not in ("auto", "gguf", "dequantized"):
            raise SSDError(f"tensor_parallel_size={n} cuts weights='gguf' or 'dequantized', not {self.weights!r}")
        plan(self.model_config, 0, n)  # a model it cannot cut fails here, before any rank starts
        if self.tensor_parallel_address is not None:
            parse_address(self.tensor_parallel_address)
            if not os.environ.get(RANK_SECRET_ENV):
                raise SSDError(f"ranks started by hand need a shared secret: set {RANK_SECRET_ENV} to the same value "
                               "on every host")
        self.threads = max(1, self.threads // n)

    @property
    def prefix_salt(self) -> str | None:
        """What names the target's cached blocks besides their tokens (None: no prefix caching)."""
        return f"{self.model}|{self.dtype}|{self.weights}" if self.enable_prefix_caching else None

    @classmethod
    def from_options(cls, model: str | os.PathLike, options: dict) -> "EngineConfig":
        """From LLM(model, **options): the engine's own options, the rest SpecOptions'."""
        own = {f.name for f in fields(cls) if f.init} - {"model", "speculation"}
        return cls(model, **{k: v for k, v in options.items() if k in own},
                   speculation=SpecOptions.from_kwargs({k: v for k, v in options.items() if k not in own}))
