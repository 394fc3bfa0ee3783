"""Batch-invariant CPU matrix products on GGUF-quantised weights, with 8-bit activations.

Why: a 4-bit model read as its own blocks streams ~7x fewer bytes per token than its fp32
copy, and decoding on a CPU is bound by those bytes. The weights are the GGUF file's, exactly
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS); the activations are quantised to 8 bits per
block of 32, each row alone (llama.cpp does the same with blocks of 256 for the K types), so
the block products are exact integer sums (AVX-512 VNNI ``vpdpbusd``) and only the
per-block scaling is floating point. The C++ source,
ssd/kernels/csrc/quant.cpp, states the arithmetic exactly: a row's result does not depend on
the number of rows in the call, what they hold, or the thread count, which keeps SD and SSD
exactly equal to AR.

At load, `repack` lays each matrix out in groups of 16 rows whose quants are interleaved 4
weights at a time, so one VNNI instruction adds 4 products into each of the 16 rows' lanes:
no horizontal sums, and each weight block is read once per call for every row of x (up to 8
per register tile), so scoring K+1 tokens costs about what scoring one does. Repacking keeps
the bytes of the file (+2-3% for unpacked sub-block scales).

Builds (ssd/kernels/build.py): ``avx512`` needs AVX-512 BW/VL, VNNI and F16C here (vpdpbusd);
``avx2`` (AVX2, FMA, F16C) runs the same block code on two 8-row halves with vpmaddubsw; a CPU
without them gets ``portable`` plain C++. All compute the same bits (integer sums are exact,
the float steps are the same); `qlinear(..., reference=True)` runs the portable code on any
build, for tests.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as GGML

from ssd.kernels.build import CppKernel

SUPPORTED = {GGML.Q4_0, GGML.Q4_1, GGML.Q5_0, GGML.Q5_1, GGML.Q8_0, GGML.IQ4_NL,
             GGML.Q2_K, GGML.Q3_K, GGML.Q4_K, GGML.Q5_K, GGML.Q6_K, GGML.IQ4_XS}
ACTIVATION_BLOCK = 32  # activation values per 8-bit block, whatever the weight type (csrc/quant.cpp)

_KERNEL = CppKernel("quant", requires={
    "avx512": ({"avx512bw", "avx512vl", "avx512_vnni", "f16c"},
               ["-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c"]),
    "avx2": ({"f16c"}, ["-mf16c"])})


def get_op(name: str, variant: str | None = None):
    """A compiled op of this kernel (repack, qlinear, dequant_rows, quantize_rows,
    quantize_q4_0, packed_bytes), building it on first use; None if it cannot be built. Never raises."""
    return _KERNEL.op(name, variant)


def available(variant: str | None = None) -> bool:
    return get_op("qlinear", variant) is not None


def variant() -> str | None:
    return _KERNEL.variant()


def runnable_variants() -> list[str]:
    return _KERNEL.runnable()


@dataclass
class QuantMatrix:
    """One weight matrix [rows, cols] of a GGUF type, repacked for `qlinear`."""

    qtype: GGML
    rows: int
    cols: int
    packed: torch.Tensor  # uint8, the layout of csrc/quant.cpp

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


def bits_per_weight(qtype: GGML) -> float:
    block, nbytes = GGML_QUANT_SIZES[GGML(qtype)]
    return 8 * nbytes / block


def quantize_q4_0(w: torch.Tensor, *, variant: str | None = None) -> torch.Tensor:
    """GGUF Q4_0 blocks (uint8 [rows, cols / 32 * 18]) of an fp32 matrix [rows, cols], bit for
    bit as the gguf package's (and ggml's reference) quantiser makes them, for a draft
    requantised to fewer bits (ssd/models/loader.py, weights="q4_0")."""
    if w.shape[-1] % 32:
        raise ValueError(f"Q4_0 needs rows of a multiple of 32 weights, got {w.shape[-1]}")
    return _op("quantize_q4_0", variant)(w.float().contiguous())


def _op(name: str, variant: str | None):
    op = get_op(name, variant)
    if op is None:
        raise RuntimeError("the CPU quant kernel is not available here (see the message above)")
    return op


def repack(raw: torch.Tensor, qtype: GGML, rows: int, cols: int, *, variant: str | None = None) -> QuantMatrix:
    """raw: the tensor's GGUF bytes (uint8), rows of `cols` weights each."""
    packed = _op("repack", variant)(raw.contiguous(), int(qtype), rows, cols)
    return QuantMatrix(GGML(qtype), rows, cols, packed)


class QuantStack:
    """Parts of one layer's output (q, k and v, say), each of its own GGUF type, as the op takes
    them: built once, so a layer's call passes them on without rebuilding lists every pass."""

    def __init__(self, parts: list[QuantMatrix]):
        k = parts[0].cols
        if any(p.cols != k for p in parts):
            raise ValueError(f"parts of different widths: {sorted({p.cols for p in parts})}")
        self.cols, self.rows = k, sum(p.rows for p in parts)
        self.packed = [p.packed for p in parts]
        self.types = [int(p.qtype) for p in parts]
        self.part_rows = [p.rows for p in parts]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, *, variant: str | None = None,
                 reference: bool = False) -> torch.Tensor:
        """x [..., K] fp32 -> [..., rows]: x @ W.T (+ bias), W the parts stacked."""
        if x.shape[-1] != self.cols:
            raise ValueError(f"x has {x.shape[-1]} features, the weights {self.cols}")
        x2 = x.reshape(-1, self.cols)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = _op("qlinear", variant)(x2, self.packed, self.types, self.part_rows, self.cols, bias, reference)
        return y.view(*x.shape[:-1], self.rows)


def qlinear(x: torch.Tensor, parts: list[QuantMatrix], bias: torch.Tensor | None = None, *,
            variant: str | None = None, reference: bool = False) -> torch.Tensor:
    """x [..., K] fp32 -> [..., sum of the parts' rows]: x @ W.T (+ bias), W the parts stacked."""
    return QuantStack(parts)(x, bias, variant=variant, reference=reference)


def dequant_rows(raw: torch.Tensor, qtype: GGML, ids: torch.Tensor, cols: int, *,
                 variant: str | None = None) -> torch.Tensor:
    """Rows `ids` of a GGUF tensor in fp32, bit for bit as the gguf package dequantises them
    (the embedding lookup)."""
    return _op("dequant_rows", variant)(raw, int(qtype), ids, cols)


def quantize_rows(x: torch.Tensor, *, variant: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8-bit activations qlinear computes with: (q int8 [M, K], d fp32 [M, K / 32])."""
    return _op("quantize_rows", variant)(x.contiguous())
