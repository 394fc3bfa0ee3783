"""GGUF types the CPU kernel reads as another of its types, with exactly the same values.

Q3_K (3.4 bits a weight) is w = d * (s_j - 32) * (q - 4) over 16-wide sub-blocks: Q6_K's form,
w = d * c_j * (u - 32), with c_j = s_j - 32 and u = q + 28. IQ4_NL is w = d * k[q] per 32, k a
table of 16 int8 values: Q8_0's form with the table's values as its quants. So these are
rewritten block by block at load (bit-identical dequantised values, tested against the gguf
package) and run on the Q6_K / Q8_0 kernels: exact, at 6.6 and 8.5 bits a weight read instead
of the file's 3.4 and 4.5 (a layout of their own, as Q2_K and IQ4_XS have in csrc/quant.cpp,
would read fewer; not written yet).
"""
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as GGML
from gguf.quants import IQ4_NL as _IQ4_NL

IQ4_NL_VALUES = np.array(_IQ4_NL.kvalues, dtype=np.int8)


def iq4_nl_as_q8_0(raw: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks (uint8, 18 bytes each: fp16 d, 16 bytes of nibbles) -> Q8_0 blocks (34 bytes)."""
    b = raw.reshape(-1, 18)
    qs = b[:, 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # element j: low nibble of byte j, j + 16: its high one
    return np.concatenate([b[:, :2], IQ4_NL_VALUES[q].view(np.uint8)], axis=1)


def q3_k_as_q6_k(raw: np.ndarray) -> np.ndarray:
    """Q3_K blocks (110 bytes: hmask[32], qs[64], scales[12], fp16 d) -> Q6_K blocks (210 bytes:
    ql[128], qh[64], scales[16] int8, fp16 d)."""
    b = raw.reshape(-1, 110)
    n = len(b)
    hmask, qs, sc, d = b[:, :32], b[:, 32:96], b[:, 96:108], b[:, 108:110]
    # Quants in the order of the dequantised row: element 128 h + 32 j + l is bits 2j of qs[32 h + l],
    # minus 4 unless bit 4 h + j of hmask[l] is set.
    low = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    high = (hmask.reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 2, 4, 1)) & 1
    q = low.astype(np.int16) - 4 * (1 - high.astype(np.int16))  # [n, 2, 4, 32] = element order, -4..3
    u = (q.reshape(n, 256) + 32).astype(np.uint8)  # Q6_K's stored quants, w = u - 32
    # The 16 six-bit scales (as the gguf package unpacks them).
    lo = (sc[:, :8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(n, 16) & 0x0F
    hi = (sc[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(n, 16) & 3
    scales = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8)
    # Q6_K's planes: for half h and l < 32, with y = u[128 h:]:
    #   ql[64 h + l] = y[l] & 15 | (y[l + 64] & 15) << 4,  ql[64 h + 32 + l] = y[l + 32] & 15 | (y[l + 96] & 15) << 4
    #   qh[32 h + l] = y[l] >> 4 | (y[l + 32] >> 4) << 2 | (y[l + 64] >> 4) << 4 | (y[l + 96] >> 4) << 6
    y = u.reshape(n, 2, 4, 32)
    ql = np.concatenate([(y[:, :, 0] & 15) | ((y[:, :, 2] & 15) << 4), (y[:, :, 1] & 15) | ((y[:, :, 3] & 15) << 4)],
                        axis=2).reshape(n, 128)
    qh = ((y[:, :, 0] >> 4) | ((y[:, :, 1] >> 4) << 2) | ((y[:, :, 2] >> 4) << 4) | ((y[:, :, 3] >> 4) << 6))
    return np.concatenate([ql, qh.reshape(n, 64), scales.view(np.uint8), d], axis=1)


AS = {GGML.IQ4_NL: (GGML.Q8_0, iq4_nl_as_q8_0), GGML.Q3_K: (GGML.Q6_K, q3_k_as_q6_k)}


def as_kernel_type(raw: np.ndarray, qtype: GGML, rows: int) -> tuple[np.ndarray, GGML]:
    """(blocks, type) the kernel reads for a matrix of `rows` rows stored as `qtype`: the same
    bytes where the kernel has the type, else the rewrite above ([rows, bytes a row])."""
    if qtype not in AS:
        return raw, qtype
    to, rewrite = AS[qtype]
    out = rewrite(np.ascontiguousarray(raw).reshape(-1, GGML_QUANT_SIZES[qtype][1]))
    return out.reshape(rows, -1), to
