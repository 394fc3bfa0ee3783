// Built by ssd/kernels/build.py; the Python side and the why: ssd/kernels/quant_cpu.py.
//
// Batch-invariant matrix products on GGUF-quantised weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
// IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS), with 8-bit activations:
//
//   repack(raw, type, N, K)          GGUF blocks [N rows of K] -> groups of 16 rows, interleaved
//   qlinear(x, parts, types, rows, K, bias)   y[M, sum rows] = x @ W.T (+ b), W the parts stacked
//   dequant_rows(raw, type, ids, K)  rows of the GGUF tensor in fp32, exactly as the gguf package
//   quantize_rows(x)                 the 8-bit activations qlinear uses (for tests)
//   quantize_q4_0(w)                 fp32 [N, K] -> GGUF Q4_0 blocks, as ggml's reference quantiser
//
// Numerics (every build does exactly this, so all give the same bits). Each activation row is
// quantised alone, per block of 32 values whatever the weight type:
//   amax = max |x_i|, dx = amax / 127, q_i = nearbyint(x_i * (127 / amax)) (0 if amax = 0),
//   sx = dx * float(sum_i q_i).
// (llama.cpp quantises a K type's activations per 256 values; per 32 they stay closer to the
// fp32 values, since one large value no longer coarsens 255 others: docs/kernels.md, "Accuracy".)
// For an output (m, n), integer products are summed exactly in int32, and each activation
// block's sum goes into the fp32 accumulator acc (from 0, in ascending order along the row,
// every step rounded once; the products marked [exact] are integers below 2^24):
//   Legacy types, per block b of 32 (w = q - 8 for Q4_0, q - 16 for Q5_0, q for Q8_0/Q4_1/Q5_1,
//   k[q] for IQ4_NL, k the table's 16 int8 values):
//     S_b = sum_i w_i q_i;   acc = fma(float(S_b), dw_b * dx_b, acc)
//     Q4_1, Q5_1 then:       acc = fma(m_b, sx_b, acc)
//   Q4_K, Q5_K, per super-block of 256: 8 sub-blocks j of 32 (each an activation block),
//     t_j = sum_{i in j} w_i q_i;  s = 0, mn = 0, then per j:
//     s = fma(float(t_j) * float(sc_j) [exact], dx_j, s);  mn = fma(float(mn_j), sx_j, mn)
//     acc = fma(s, d, acc);  acc = fma(-mn, dmin, acc)
//   IQ4_XS (w = k[q], k the 16 int8 values of IQ4_NL's table): as Q4_K with sc_j = ls_j - 32
//     (signed) and no mins: s = fma(float(t_j) * float(sc_j) [exact: below 2^24], dx_j, s);
//     acc = fma(s, d, acc)
//   Q6_K (w = q - 32) and Q3_K (w = q - 4, signed 6-bit scales), per pair p of their 16-wide
//     sub-blocks a = 2p, b = 2p + 1 (an activation block):
//     S_p = float(t_a) * float(sc_a) + float(t_b) * float(sc_b) [exact];  acc = fma(S_p, d * dx_p, acc)
//   Q2_K (w = q, 0..3; 16-wide sub-blocks with a scale and a min each): s = 0, mn = 0;
//     per pair p as Q6_K: s = fma(S_p, dx_p, s); per sub-block j, with hx_j = dx * float(sum of
//     q over j's half of the activation block): mn = fma(float(m_j), hx_j, mn);
//     acc = fma(s, d, acc);  acc = fma(-mn, dmin, acc)
// and y = acc (+ b[n]). Nothing depends on M, the other rows or the thread count.
//
// Packed layout: rows in groups of G = 16 (the last one padded with zeros); per group, per
// block, the 16 rows' scales and their quants interleaved so that one 64-byte vector holds 4
// consecutive weights of each of the 16 rows ("k-group"): byte i is row i / 4, weight i % 4.
// With AVX-512 VNNI one vpdpbusd then adds 4 products into each row's int32 lane, for all 16
// rows at once, and no horizontal sum is ever needed. 4-bit quants are stored as nibble
// pairs (low nibble: k-group 2v, high: 2v + 1); 5th bits as one 64-bit mask per k-group; Q6_K's
// top two bits, and Q2_K's and Q3_K's low two, as 2-bit fields, four k-groups per byte plane
// (bits 2c, 2c + 1: k-group 4u + c), Q3_K's third bit as Q5's 5th: each takes about the
// file's bits. IQ4_NL and IQ4_XS keep their 4-bit indices; the kernel maps them through the
// table with a byte shuffle.
// A K-type block is its scales, then 8 chunks, one per activation block of 32 weights, each
// holding that block's quants in the order the kernel reads them (Q4_K: 4 nibble vectors;
// Q5_K: those and the 8 k-groups' 5th-bit masks; Q6_K: per 16-wide sub-block, its top-bit plane
// then its 2 nibble vectors). So each group is read front to back as one stream, which is what
// CPUs' hardware prefetchers follow (with the bit planes after all the nibbles, Q6_K read two
// streams 2 KB apart and ran at half the bandwidth on an AMD EPYC).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>
#include "library.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "isa.h"

// Beyond isa.h's ISA the fast code needs F16C, and its AVX-512 path BW, VL and VNNI (vpdpbusd):
// build.py adds their flags where the CPU has them (quant_cpu.py). SSD_FAST_X86 without SSD_VNNI
// is the AVX2 path; on aarch64 the fast code is NEON's, its dot products SDOT where the CPU has
// the dot-product extension (SSD_DOTPROD), else widening multiplies and pairwise adds.
#if SSD_AVX512 && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define SSD_VNNI 1
#else
#define SSD_VNNI 0
#endif
#if SSD_AVX2 && defined(__F16C__)
#define SSD_FAST_X86 1
#else
#define SSD_FAST_X86 0
#endif
#if SSD_FAST_X86 || SSD_NEON
#define SSD_FAST 1
#else
#define SSD_FAST 0
#endif

namespace {

constexpr int G = 16;  // rows per group
enum Type : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13,
                      Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23 };

// IQ4_NL's (and IQ4_XS's) 16 weights, as the gguf package has them.
constexpr int8_t KVALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

struct Info {
  int block;       // weights per block
  int raw_bytes;   // bytes of one GGUF block
  int pack_bytes;  // bytes of one block of a 16-row group, packed
};

static bool known(int64_t t) {
  switch (t) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: case IQ4_NL:
    case Q2_K: case Q3_K: case Q4_K: case Q5_K: case Q6_K: case IQ4_XS:
      return true;
    default: return false;
  }
}

static Info info(int64_t t) {
  switch (t) {
    case Q4_0: return {32, 18, 32 + 256};
    case Q4_1: return {32, 20, 64 + 256};
    case Q5_0: return {32, 22, 32 + 256 + 64};
    case Q5_1: return {32, 24, 64 + 256 + 64};
    case Q8_0: return {32, 34, 32 + 512};
    case IQ4_NL: return {32, 18, 32 + 256};
    case Q4_K: return {256, 144, 64 + 256 + 2048};
    case Q5_K: return {256, 176, 64 + 256 + 2048 + 512};
    case Q6_K: return {256, 210, 32 + 256 + 2048 + 1024};
    case Q2_K: return {256, 84, 64 + 256 + 1024};
    case Q3_K: return {256, 110, 32 + 256 + 16 * 96};
    case IQ4_XS: return {256, 136, 32 + 128 + 2048};
  }
  TORCH_CHECK(false, "ssd quant: unsupported GGUF type ", t);
}

static bool k_type(int64_t t) { return t == Q2_K || t == Q3_K || t == Q4_K || t == Q5_K || t == Q6_K || t == IQ4_XS; }

// ---- fp16 -> fp32, exact (normal, subnormal, inf, nan) -----------------------------------------
static inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do { ++e; man <<= 1; } while (!(man & 0x400));
    bits = sign | uint32_t(112 - e) << 23 | ((man & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

static inline uint16_t rd16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
static inline uint32_t rd32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }

// Q4_K / Q5_K 6-bit scale and min of sub-block j from the 12 packed bytes (as the gguf package).
static inline void scale_min_k4(int j, const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// IQ4_XS's signed 6-bit scale of sub-block j: 4 low bits from scales_l (byte 4 + j / 2), 2 high
// ones from scales_h (bits 2j, 2j + 1), minus 32.
static inline int iq4xs_scale(const uint8_t* b, int j) {
  const int lo = (b[4 + j / 2] >> (4 * (j % 2))) & 0x0F, hi = (rd16(b + 2) >> (2 * j)) & 3;
  return (lo | (hi << 4)) - 32;
}

// Q3_K's signed 6-bit scale of sub-block j: 4 low bits from byte 96 + j % 8 (low nibble for
// j < 8), 2 high ones from byte 104 + j % 4 (bits 2 (j / 4), + 1), minus 32.
static inline int q3k_scale(const uint8_t* b, int j) {
  const int lo = (b[96 + j % 8] >> (4 * (j / 8))) & 0x0F, hi = (b[104 + j % 4] >> (2 * (j / 4))) & 3;
  return (lo | (hi << 4)) - 32;
}

// ---- one GGUF block -> integer quants (the values the gguf package multiplies by its scales) ----
// Legacy types: q[32] (0..15 / 0..31 / -128..127, before any offset). K types: q[256] unsigned
// (Q6_K: 0..63, before -32; IQ4_XS: the table's indices), in the element order of the dequantised row.
static void unpack_block(int64_t t, const uint8_t* b, int32_t* q) {
  switch (t) {
    case Q4_0: case Q4_1: case IQ4_NL: {
      const uint8_t* qs = b + (t == Q4_1 ? 4 : 2);
      for (int j = 0; j < 16; ++j) { q[j] = qs[j] & 0x0F; q[j + 16] = qs[j] >> 4; }
      break;
    }
    case Q5_0: case Q5_1: {
      const uint8_t* p = b + (t == Q5_0 ? 2 : 4);
      const uint32_t qh = rd32(p);
      const uint8_t* qs = p + 4;
      for (int j = 0; j < 16; ++j) {
        q[j] = (qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
        q[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      }
      break;
    }
    case Q8_0:
      for (int j = 0; j < 32; ++j) q[j] = int8_t(b[2 + j]);
      break;
    case Q4_K: case Q5_K: {
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (t == Q4_K ? 16 : 48);
      for (int g = 0; g < 4; ++g)
        for (int l = 0; l < 32; ++l) {
          q[64 * g + l] = qs[32 * g + l] & 0x0F;
          q[64 * g + 32 + l] = qs[32 * g + l] >> 4;
          if (t == Q5_K) {
            q[64 * g + l] |= ((qh[l] >> (2 * g)) & 1) << 4;
            q[64 * g + 32 + l] |= ((qh[l] >> (2 * g + 1)) & 1) << 4;
          }
        }
      break;
    }
    case Q2_K:  // element 128 h + 32 c + l: bits 2c of qs[32 h + l]
      for (int i = 0; i < 256; ++i) q[i] = (b[16 + 32 * (i / 128) + i % 32] >> (2 * (i % 128 / 32))) & 3;
      break;
    case Q3_K:  // as Q2_K's (qs at 32), plus 4 where bit i / 32 of hmask[i % 32] is set: 0..7, w = q - 4
      for (int i = 0; i < 256; ++i)
        q[i] = ((b[32 + 32 * (i / 128) + i % 32] >> (2 * (i % 128 / 32))) & 3) | (((b[i % 32] >> (i / 32)) & 1) << 2);
      break;
    case IQ4_XS:  // sub-block j, element l: the low nibble of qs[16 j + l], l + 16 its high one
      for (int j = 0; j < 8; ++j)
        for (int l = 0; l < 16; ++l) {
          q[32 * j + l] = b[8 + 16 * j + l] & 0x0F;
          q[32 * j + 16 + l] = b[8 + 16 * j + l] >> 4;
        }
      break;
    case Q6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      for (int h = 0; h < 2; ++h)
        for (int l = 0; l < 32; ++l) {
          const uint8_t* L = ql + 64 * h;
          const uint8_t H = qh[32 * h + l];
          int32_t* y = q + 128 * h;
          y[l] = (L[l] & 0x0F) | ((H & 3) << 4);
          y[l + 32] = (L[l + 32] & 0x0F) | (((H >> 2) & 3) << 4);
          y[l + 64] = (L[l] >> 4) | (((H >> 4) & 3) << 4);
          y[l + 96] = (L[l + 32] >> 4) | (((H >> 6) & 3) << 4);
        }
      break;
    }
  }
}

// ---- dequantisation of whole rows, exactly as the gguf package computes it (fp32, no fma) -------
static void dequant_block(int64_t t, const uint8_t* b, float* y) {
  int32_t q[256];
  unpack_block(t, b, q);
  switch (t) {
    case Q4_0: case Q5_0: case Q8_0: {
      const float d = half_to_float(rd16(b));
      const int off = t == Q4_0 ? 8 : t == Q5_0 ? 16 : 0;
      for (int j = 0; j < 32; ++j) y[j] = d * float(q[j] - off);
      break;
    }
    case IQ4_NL: {
      const float d = half_to_float(rd16(b));
      for (int j = 0; j < 32; ++j) y[j] = d * float(KVALUES[q[j]]);
      break;
    }
    case Q4_1: case Q5_1: {
      const float d = half_to_float(rd16(b)), m = half_to_float(rd16(b + 2));
      for (int j = 0; j < 32; ++j) y[j] = d * float(q[j]) + m;
      break;
    }
    case Q4_K: case Q5_K: {
      const float d = half_to_float(rd16(b)), dmin = half_to_float(rd16(b + 2));
      for (int j = 0; j < 8; ++j) {
        uint8_t sc, mn;
        scale_min_k4(j, b + 4, &sc, &mn);
        const float d1 = d * float(sc), m1 = dmin * float(mn);
        for (int l = 0; l < 32; ++l) y[32 * j + l] = d1 * float(q[32 * j + l]) - m1;
      }
      break;
    }
    case Q2_K: {
      const float d = half_to_float(rd16(b + 80)), dmin = half_to_float(rd16(b + 82));
      for (int j = 0; j < 16; ++j) {
        const float d1 = d * float(b[j] & 0x0F), m1 = dmin * float(b[j] >> 4);
        for (int l = 0; l < 16; ++l) y[16 * j + l] = d1 * float(q[16 * j + l]) - m1;
      }
      break;
    }
    case Q3_K: {
      const float d = half_to_float(rd16(b + 108));
      for (int j = 0; j < 16; ++j) {
        const float d1 = d * float(q3k_scale(b, j));
        for (int l = 0; l < 16; ++l) y[16 * j + l] = d1 * float(q[16 * j + l] - 4);
      }
      break;
    }
    case IQ4_XS: {
      const float d = half_to_float(rd16(b));
      for (int j = 0; j < 8; ++j) {
        const float d1 = d * float(iq4xs_scale(b, j));
        for (int l = 0; l < 32; ++l) y[32 * j + l] = d1 * float(KVALUES[q[32 * j + l]]);
      }
      break;
    }
    case Q6_K: {
      const float d = half_to_float(rd16(b + 208));
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      for (int j = 0; j < 16; ++j) {
        const float d1 = d * float(sc[j]);
        for (int l = 0; l < 16; ++l) y[16 * j + l] = d1 * float(q[16 * j + l] - 32);
      }
      break;
    }
  }
}

at::Tensor dequant_rows(const at::Tensor& raw, int64_t type, const at::Tensor& ids, int64_t K) {
  TORCH_CHECK(known(type), "ssd quant: unsupported GGUF type ", type);
  const Info in = info(type);
  TORCH_CHECK(K % in.block == 0, "ssd quant: row length ", K, " is not a multiple of ", in.block);
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.device().is_cpu(), "ssd quant: raw bytes");
  const int64_t nb = K / in.block, row_bytes = nb * in.raw_bytes, rows = raw.numel() / row_bytes;
  TORCH_CHECK(raw.numel() == rows * row_bytes, "ssd quant: the data is not whole rows");
  auto idc = ids.to(at::kLong).contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  const int64_t T = idc.numel();
  for (int64_t i = 0; i < T; ++i) TORCH_CHECK(0 <= id[i] && id[i] < rows, "ssd quant: row ", id[i], " out of range");
  at::Tensor y = at::empty({T, K}, at::kFloat);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  float* dst = y.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t i = t0; i < t1; ++i)
      for (int64_t b = 0; b < nb; ++b) dequant_block(type, src + id[i] * row_bytes + b * in.raw_bytes,
                                                     dst + i * K + b * in.block);
  });
  return y;
}

// ---- repacking -----------------------------------------------------------------------------
// Within a packed group-block: the quants of "k-group" kg (4 consecutive weights of all 16
// rows) are 64 values in the order (row r, weight e) -> r * 4 + e.
static inline int vpos(int r, int e) { return r * 4 + e; }

// Nibble plane of nkg k-groups (nkg even): byte i of vector v: low nibble = k-group 2v, high = 2v+1.
static void put_nibbles(uint8_t* dst, const int32_t (*q)[256], int nkg) {
  for (int v = 0; v < nkg / 2; ++v)
    for (int r = 0; r < G; ++r)
      for (int e = 0; e < 4; ++e) {
        const int lo = q[r][4 * (2 * v) + e] & 0x0F, hi = q[r][4 * (2 * v + 1) + e] & 0x0F;
        dst[64 * v + vpos(r, e)] = uint8_t(lo | (hi << 4));
      }
}

// One 64-bit mask per k-group: bit vpos(r, e) = bit `bit` of the quant.
static void put_bits(uint8_t* dst, const int32_t (*q)[256], int nkg, int bit) {
  for (int kg = 0; kg < nkg; ++kg) {
    uint64_t m = 0;
    for (int r = 0; r < G; ++r)
      for (int e = 0; e < 4; ++e) m |= uint64_t((q[r][4 * kg + e] >> bit) & 1) << vpos(r, e);
    std::memcpy(dst + 8 * kg, &m, 8);
  }
}

// Two bits of each quant (bits `shift`, `shift` + 1: Q6_K's top two, Q2_K's only two): plane u
// (64 bytes) holds k-groups 4u .. 4u + 3, k-group 4u + c in bits 2c, 2c + 1.
static void put_2bits(uint8_t* dst, const int32_t (*q)[256], int shift) {
  for (int u = 0; u < 16; ++u)
    for (int r = 0; r < G; ++r)
      for (int e = 0; e < 4; ++e) {
        int byte = 0;
        for (int c = 0; c < 4; ++c) byte |= ((q[r][4 * (4 * u + c) + e] >> shift) & 3) << (2 * c);
        dst[64 * u + vpos(r, e)] = uint8_t(byte);
      }
}

// Bytes of one chunk of a K-type block (the quants of one activation block of 32), and of the
// scales before the first chunk.
static constexpr int k_chunk(int64_t t) {
  return t == Q4_K || t == IQ4_XS ? 256 : t == Q5_K ? 320 : t == Q2_K ? 128 : t == Q3_K ? 192 : 384;
}
static constexpr int k_head(int64_t t) { return t == Q6_K || t == Q3_K ? 288 : t == IQ4_XS ? 160 : 320; }

// A K-type block's 8 chunks from the planes above (see the layout at the top).
static void put_k_chunks(int64_t t, uint8_t* dst, const int32_t (*q)[256]) {
  uint8_t nib[2048], ext[1024];
  if (t == Q2_K) {  // the planes alone, in order: chunk c is planes 2c, 2c + 1
    put_2bits(dst, q, 0);
    return;
  }
  if (t == Q3_K) {  // per 16-wide sub-block: its plane of low bits, then its 4 k-groups' third-bit masks
    put_2bits(ext, q, 0);
    put_bits(nib, q, 64, 2);
    for (int j = 0; j < 16; ++j) {
      std::memcpy(dst + 96 * j, ext + 64 * j, 64);
      std::memcpy(dst + 96 * j + 64, nib + 32 * j, 32);
    }
    return;
  }
  put_nibbles(nib, q, 64);  // 128 bytes per 16-wide sub-block
  if (t == Q5_K) put_bits(ext, q, 64, 4);  // 64 bytes per chunk
  if (t == Q6_K) put_2bits(ext, q, 4);  // 64 bytes per 16-wide sub-block
  for (int c = 0; c < 8; ++c) {
    uint8_t* ch = dst + c * k_chunk(t);
    if (t == Q6_K) {
      for (int h = 0; h < 2; ++h) {
        std::memcpy(ch + 192 * h, ext + 64 * (2 * c + h), 64);
        std::memcpy(ch + 192 * h + 64, nib + 128 * (2 * c + h), 128);
      }
    } else {
      std::memcpy(ch, nib + 256 * c, 256);
      if (t == Q5_K) std::memcpy(ch + 256, ext + 64 * c, 64);
    }
  }
}

static void pack_group_block(int64_t t, const uint8_t* const* rows, uint8_t* out) {
  // rows[r]: the raw GGUF block of row r of the group (nullptr: a padding row, all zero).
  static thread_local int32_t q[G][256];
  for (int r = 0; r < G; ++r) {
    if (rows[r]) unpack_block(t, rows[r], q[r]);
    else std::fill(q[r], q[r] + 256, 0);
  }
  auto half = [&](int r, int off) -> uint16_t { return rows[r] ? rd16(rows[r] + off) : 0; };
  uint8_t* p = out;
  auto scaled = [&](int d_off, int nsub, int (*scale)(const uint8_t*, int)) {
    for (int r = 0; r < G; ++r) { const uint16_t d = half(r, d_off); std::memcpy(p + 2 * r, &d, 2); }
    for (int r = 0; r < G; ++r)
      for (int j = 0; j < nsub; ++j) p[32 + 16 * j + r] = rows[r] ? uint8_t(int8_t(scale(rows[r], j))) : 0;
    put_k_chunks(t, p + 32 + 16 * nsub, q);
  };
  switch (t) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case IQ4_NL: {
      for (int r = 0; r < G; ++r) { const uint16_t d = half(r, 0); std::memcpy(p + 2 * r, &d, 2); }
      p += 32;
      if (t == Q4_1 || t == Q5_1) {
        for (int r = 0; r < G; ++r) { const uint16_t m = half(r, 2); std::memcpy(p + 2 * r, &m, 2); }
        p += 32;
      }
      put_nibbles(p, q, 8);
      p += 256;
      if (t == Q5_0 || t == Q5_1) put_bits(p, q, 8, 4);
      break;
    }
    case Q8_0: {
      for (int r = 0; r < G; ++r) { const uint16_t d = half(r, 0); std::memcpy(p + 2 * r, &d, 2); }
      p += 32;
      for (int kg = 0; kg < 8; ++kg)
        for (int r = 0; r < G; ++r)
          for (int e = 0; e < 4; ++e) p[64 * kg + vpos(r, e)] = uint8_t(q[r][4 * kg + e] + 128);
      break;
    }
    case Q4_K: case Q5_K: {
      for (int r = 0; r < G; ++r) {
        const uint16_t d = half(r, 0), dm = half(r, 2);
        std::memcpy(p + 2 * r, &d, 2);
        std::memcpy(p + 32 + 2 * r, &dm, 2);
      }
      p += 64;
      for (int j = 0; j < 8; ++j)
        for (int r = 0; r < G; ++r) {
          uint8_t sc = 0, mn = 0;
          if (rows[r]) scale_min_k4(j, rows[r] + 4, &sc, &mn);
          p[16 * j + r] = sc;
          p[128 + 16 * j + r] = mn;
        }
      p += 256;
      put_k_chunks(t, p, q);
      break;
    }
    case Q2_K: {
      for (int r = 0; r < G; ++r) {
        const uint16_t d = half(r, 80), dm = half(r, 82);
        std::memcpy(p + 2 * r, &d, 2);
        std::memcpy(p + 32 + 2 * r, &dm, 2);
      }
      p += 64;
      for (int r = 0; r < G; ++r)  // each sub-block's scale (low nibble) and min (high), as in the file
        for (int j = 0; j < 16; ++j) p[16 * j + r] = rows[r] ? rows[r][j] : 0;
      p += 256;
      put_k_chunks(t, p, q);
      break;
    }
    // One fp16 d a row, then signed sub-block scales (`nsub` a row), then the chunks.
    case Q3_K: scaled(108, 16, q3k_scale); break;
    case IQ4_XS: scaled(0, 8, iq4xs_scale); break;
    case Q6_K: scaled(208, 16, [](const uint8_t* b, int j) { return int(int8_t(b[192 + j])); }); break;
  }
}

at::Tensor repack(const at::Tensor& raw, int64_t type, int64_t N, int64_t K) {
  TORCH_CHECK(known(type), "ssd quant: unsupported GGUF type ", type);
  const Info in = info(type);
  TORCH_CHECK(N > 0 && K > 0 && K % in.block == 0, "ssd quant: bad shape ", N, " x ", K);
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.device().is_cpu(), "ssd quant: raw bytes");
  const int64_t nb = K / in.block, row_bytes = nb * in.raw_bytes, groups = (N + G - 1) / G;
  TORCH_CHECK(raw.numel() == N * row_bytes, "ssd quant: expected ", N * row_bytes, " bytes, got ", raw.numel());
  at::Tensor out = at::empty({groups * nb * in.pack_bytes}, at::kByte);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    const uint8_t* rows[G];
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        for (int r = 0; r < G; ++r) {
          const int64_t n = g * G + r;
          rows[r] = n < N ? src + n * row_bytes + b * in.raw_bytes : nullptr;
        }
        pack_group_block(type, rows, dst + (g * nb + b) * in.pack_bytes);
      }
  });
  return out;
}

// ---- activations --------------------------------------------------------------------------
// Activation rows quantised per block of 32 values. The plain arrays serve the portable code;
// the fast code reads the same values laid out per tile of MT rows, each k-group's 4 bytes of
// the tile's rows side by side, so that every broadcast is one load.
constexpr int AB = 32;  // values per activation block
// Rows of x per tile: a tile's rows pass over each block of weights together, so a pass of up
// to MT rows streams the weights once. With VNNI the whole tile's accumulators stay in registers;
// AVX2 takes a large tile's rows in parts (V::kPart, its 16 ymm registers), the block in L1 by then.
constexpr int MT = SSD_VNNI ? 8 : 16;
constexpr int64_t MIN_GROUPS_PER_THREAD = 8;


struct Act {
  int64_t K = 0, nb = 0, M = 0;
  std::vector<int8_t> q;      // [M][K]
  std::vector<float> d;       // [M][nb]
  std::vector<float> sx;      // [M][nb] d * float(sum of q over the block)
  std::vector<float> hx;      // [M][2 nb] d * float(sum of q over each half block) (Q2_K's mins)
  // Tiled, tile t = rows MT*t .. MT*t + MT - 1 (a tile lacks the rows past M; never read):
  std::vector<int8_t> qt;     // [tiles][K/4][rows of the tile][4], MT * K bytes per tile
  std::vector<float> dt;      // [tiles][nb][MT] d
  std::vector<int32_t> st;    // [tiles][nb][MT] sum of q over the block
  std::vector<float> sxt;     // [tiles][nb][MT] sx
  std::vector<int32_t> s16t;  // [tiles][2 nb][MT] -32 * the sum of q over each half block (Q6_K's w + 32)
  std::vector<float> hxt;     // [tiles][2 nb][MT] hx
};

// Rows of x in tile t: a tile's k-groups hold only its rows, so a single row's activations take
// K bytes, not MT * K (they are read again for every group of weights: L1 should hold them).
static inline int64_t tile_rows(int64_t M, int64_t t) { return std::min<int64_t>(MT, M - t * MT); }

// One block of 32 values: q, and the sums of q over its halves; returns amax. The SIMD code
// computes exactly what the scalar loop does (max and the products are exact or rounded once
// alike, vroundps/vrndscaleps round half to even as nearbyint does; a NaN is skipped by the
// max and becomes -127 in both): it runs once per value of x per call, and scalar it cost
// ~3 ns a value, on one thread, about a millisecond per row of a 1.5B model's pass.
static inline float quantize_block(const float* xb, int8_t* q, int32_t* half) {
#if SSD_VNNI
  const __m512 a0 = _mm512_loadu_ps(xb), a1 = _mm512_loadu_ps(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a1), _mm512_max_ps(_mm512_abs_ps(a0), _mm512_setzero_ps())));
  const __m512 id = _mm512_set1_ps(amax != 0.f ? 127.f / amax : 0.f), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  auto one = [&](__m512 v) {
    const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
  };
  const __m512i i0 = one(a0), i1 = one(a1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(i0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(i1));
  half[0] = _mm512_reduce_add_epi32(i0);
  half[1] = _mm512_reduce_add_epi32(i1);
  return amax;
#elif SSD_FAST_X86
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], m = _mm256_setzero_ps();
  for (int k = 0; k < 4; ++k) {
    v[k] = _mm256_loadu_ps(xb + 8 * k);
    m = _mm256_max_ps(_mm256_andnot_ps(sign, v[k]), m);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float amax = 0.f;
  for (float l : lanes) amax = std::max(amax, l);
  const __m256 id = _mm256_set1_ps(amax != 0.f ? 127.f / amax : 0.f), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  alignas(32) int32_t iq[32];
  for (int k = 0; k < 4; ++k) {
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[k], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_store_si256(reinterpret_cast<__m256i*>(iq + 8 * k), _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi)));
  }
  half[0] = half[1] = 0;
  for (int i = 0; i < AB; ++i) {
    q[i] = int8_t(iq[i]);
    half[i / 16] += iq[i];
  }
  return amax;
#else
  float amax = 0.f;
  for (int i = 0; i < AB; ++i) amax = std::max(amax, std::fabs(xb[i]));
  const float id = amax != 0.f ? 127.f / amax : 0.f;
  half[0] = half[1] = 0;
  for (int i = 0; i < AB; ++i) {
    const float v = std::nearbyint(xb[i] * id);
    q[i] = int8_t(std::min(127.f, std::max(-127.f, v)));
    half[i / 16] += q[i];
  }
  return amax;
#endif
}

static void quantize_act(const float* x, int64_t ldx, int64_t M, int64_t K, Act& a) {
  a.K = K;
  a.M = M;
  a.nb = K / AB;
  a.q.resize(M * K);
  a.d.resize(M * a.nb);
  a.sx.resize(M * a.nb);
  a.hx.resize(M * 2 * a.nb);
#if SSD_FAST
  const int64_t tiles = (M + MT - 1) / MT, kgs = K / 4;
  a.qt.resize(tiles * kgs * MT * 4);  // (no zero fill: every byte read is written below)
  a.dt.resize(tiles * a.nb * MT);
  a.st.resize(tiles * a.nb * MT);
  a.sxt.resize(tiles * a.nb * MT);
  a.s16t.resize(tiles * a.nb * 2 * MT);
  a.hxt.resize(tiles * a.nb * 2 * MT);
#endif
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < a.nb; ++b) {
      int32_t half[2];
      const float d = quantize_block(x + m * ldx + b * AB, a.q.data() + m * K + b * AB, half) / 127.f;
      const int32_t s = half[0] + half[1];
      a.d[m * a.nb + b] = d;
      a.sx[m * a.nb + b] = d * float(s);
      a.hx[(m * a.nb + b) * 2] = d * float(half[0]);
      a.hx[(m * a.nb + b) * 2 + 1] = d * float(half[1]);
#if SSD_FAST
      const int64_t i = (m / MT * a.nb + b) * MT + m % MT;  // [tile][b][row in tile]
      a.dt[i] = d;
      a.st[i] = s;
      a.sxt[i] = a.sx[m * a.nb + b];
      a.s16t[(m / MT * a.nb + b) * 2 * MT + m % MT] = -32 * half[0];
      a.s16t[(m / MT * a.nb + b) * 2 * MT + MT + m % MT] = -32 * half[1];
      a.hxt[(m / MT * a.nb + b) * 2 * MT + m % MT] = a.hx[(m * a.nb + b) * 2];
      a.hxt[(m / MT * a.nb + b) * 2 * MT + MT + m % MT] = a.hx[(m * a.nb + b) * 2 + 1];
#endif
    }
#if SSD_FAST
    const int64_t t = m / MT, rows = tile_rows(M, t);
    const int8_t* src = a.q.data() + m * K;
    int8_t* dst = a.qt.data() + (t * kgs * MT + m % MT) * 4;
    for (int64_t kg = 0; kg < kgs; ++kg) std::memcpy(dst + kg * rows * 4, src + 4 * kg, 4);
#endif
  }
}

// ---- the products: portable reference -----------------------------------------------------
// Decodes a packed group-block back to integer weights w[r][i] (with offsets applied) and the
// per-row scales, then follows the definition above literally.
struct GroupBlock {
  float d[G], dmin[G], m[G];
  int32_t w[G][256];
  int32_t sc[G][16], mn[G][16];
};

static void decode_group_block(int64_t t, const uint8_t* p, GroupBlock& gb) {
  auto nib = [&](const uint8_t* plane, int kg, int r, int e) -> int32_t {
    const uint8_t byte = plane[64 * (kg / 2) + vpos(r, e)];
    return kg % 2 ? byte >> 4 : byte & 0x0F;
  };
  auto bit = [&](const uint8_t* plane, int kg, int r, int e) -> int32_t {
    uint64_t mask;
    std::memcpy(&mask, plane + 8 * kg, 8);
    return int32_t((mask >> vpos(r, e)) & 1);
  };
  switch (t) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: {
      const bool has_m = t == Q4_1 || t == Q5_1, five = t == Q5_0 || t == Q5_1;
      const uint8_t* qs = p + (has_m ? 64 : 32);
      const int off = t == Q4_0 ? 8 : t == Q5_0 ? 16 : 0;
      for (int r = 0; r < G; ++r) {
        gb.d[r] = half_to_float(rd16(p + 2 * r));
        gb.m[r] = has_m ? half_to_float(rd16(p + 32 + 2 * r)) : 0.f;
        for (int kg = 0; kg < 8; ++kg)
          for (int e = 0; e < 4; ++e)
            gb.w[r][4 * kg + e] = nib(qs, kg, r, e) + (five ? bit(qs + 256, kg, r, e) << 4 : 0) - off;
      }
      break;
    }
    case Q8_0:
      for (int r = 0; r < G; ++r) {
        gb.d[r] = half_to_float(rd16(p + 2 * r));
        for (int kg = 0; kg < 8; ++kg)
          for (int e = 0; e < 4; ++e) gb.w[r][4 * kg + e] = int32_t(p[32 + 64 * kg + vpos(r, e)]) - 128;
      }
      break;
    case IQ4_NL:
      for (int r = 0; r < G; ++r) {
        gb.d[r] = half_to_float(rd16(p + 2 * r));
        for (int kg = 0; kg < 8; ++kg)
          for (int e = 0; e < 4; ++e) gb.w[r][4 * kg + e] = KVALUES[nib(p + 32, kg, r, e)];
      }
      break;
    case Q3_K:
      for (int r = 0; r < G; ++r) {
        gb.d[r] = half_to_float(rd16(p + 2 * r));
        for (int j = 0; j < 16; ++j) gb.sc[r][j] = int8_t(p[32 + 16 * j + r]);
        for (int kg = 0; kg < 64; ++kg) {
          const uint8_t* sub = p + k_head(t) + 96 * (kg / 4);  // the plane of low bits, then 4 masks
          for (int e = 0; e < 4; ++e)
            gb.w[r][4 * kg + e] = ((sub[vpos(r, e)] >> (2 * (kg % 4))) & 3) + (bit(sub + 64, kg % 4, r, e) << 2) - 4;
        }
      }
      break;
    case Q4_K: case Q5_K:
      for (int r = 0; r < G; ++r) {
        gb.d[r] = half_to_float(rd16(p + 2 * r));
        gb.dmin[r] = half_to_float(rd16(p + 32 + 2 * r));
        for (int j = 0; j < 8; ++j) {
          gb.sc[r][j] = p[64 + 16 * j + r];
          gb.mn[r][j] = p[192 + 16 * j + r];
        }
        for (int kg = 0; kg < 64; ++kg) {
          const uint8_t* ch = p + k_head(t) + k_chunk(t) * (kg / 8);  // nibble vectors, then Q5_K's masks
          for (int e = 0; e < 4; ++e)
            gb.w[r][4 * kg + e] = nib(ch, kg % 8, r, e) + (t == Q5_K ? bit(ch + 256, kg % 8, r, e) << 4 : 0);
        }
      }
      break;
    case Q2_K:
      for (int r = 0; r < G; ++r) {
        gb.d[r] = half_to_float(rd16(p + 2 * r));
        gb.dmin[r] = half_to_float(rd16(p + 32 + 2 * r));
        for (int j = 0; j < 16; ++j) {
          gb.sc[r][j] = p[64 + 16 * j + r] & 0x0F;
          gb.mn[r][j] = p[64 + 16 * j + r] >> 4;
        }
        for (int kg = 0; kg < 64; ++kg)
          for (int e = 0; e < 4; ++e) gb.w[r][4 * kg + e] = (p[k_head(t) + 64 * (kg / 4) + vpos(r, e)] >> (2 * (kg % 4))) & 3;
      }
      break;
    case IQ4_XS:
      for (int r = 0; r < G; ++r) {
        gb.d[r] = half_to_float(rd16(p + 2 * r));
        for (int j = 0; j < 8; ++j) gb.sc[r][j] = int8_t(p[32 + 16 * j + r]);
        for (int kg = 0; kg < 64; ++kg) {
          const uint8_t* ch = p + k_head(t) + k_chunk(t) * (kg / 8);
          for (int e = 0; e < 4; ++e) gb.w[r][4 * kg + e] = KVALUES[nib(ch, kg % 8, r, e)];
        }
      }
      break;
    case Q6_K:
      for (int r = 0; r < G; ++r) {
        gb.d[r] = half_to_float(rd16(p + 2 * r));
        for (int j = 0; j < 16; ++j) gb.sc[r][j] = int8_t(p[32 + 16 * j + r]);
        for (int kg = 0; kg < 64; ++kg) {
          const uint8_t* sub = p + k_head(t) + 192 * (kg / 4);  // the top-bit plane, then 2 nibble vectors
          for (int e = 0; e < 4; ++e)
            gb.w[r][4 * kg + e] = nib(sub + 64, kg % 4, r, e) + (((sub[vpos(r, e)] >> (2 * (kg % 4))) & 3) << 4) - 32;
        }
      }
      break;
  }
}

static void group_portable(int64_t t, const uint8_t* packed, int64_t nb, const Act& a, int64_t M,
                           float* acc /* [M][G] */) {
  const Info in = info(t);
  const int64_t per = in.block / AB;  // activation blocks per weight block
  static thread_local GroupBlock gb;
  std::fill(acc, acc + M * G, 0.f);
  for (int64_t b = 0; b < nb; ++b) {
    decode_group_block(t, packed + b * in.pack_bytes, gb);
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* q = a.q.data() + m * a.K + b * in.block;
      const float* dx = a.d.data() + m * a.nb + b * per;
      const float* sx = a.sx.data() + m * a.nb + b * per;
      const float* hx = a.hx.data() + (m * a.nb + b * per) * 2;
      for (int r = 0; r < G; ++r) {
        float& y = acc[m * G + r];
        auto dot = [&](int from, int n) {
          int32_t s = 0;
          for (int i = from; i < from + n; ++i) s += gb.w[r][i] * q[i];
          return s;
        };
        if (!k_type(t)) {
          y = std::fma(float(dot(0, 32)), gb.d[r] * dx[0], y);
          if (t == Q4_1 || t == Q5_1) y = std::fma(gb.m[r], sx[0], y);
        } else if (t == Q6_K || t == Q3_K || t == Q2_K) {
          float s = 0.f, mn = 0.f;
          for (int p = 0; p < 8; ++p) {
            const float sp = float(dot(32 * p, 16)) * float(gb.sc[r][2 * p]) +
                             float(dot(32 * p + 16, 16)) * float(gb.sc[r][2 * p + 1]);
            if (t != Q2_K) y = std::fma(sp, gb.d[r] * dx[p], y);
            else s = std::fma(sp, dx[p], s);
          }
          if (t == Q2_K) {
            for (int j = 0; j < 16; ++j) mn = std::fma(float(gb.mn[r][j]), hx[j], mn);
            y = std::fma(s, gb.d[r], y);
            y = std::fma(-mn, gb.dmin[r], y);
          }
        } else {
          float s = 0.f, mn = 0.f;
          for (int j = 0; j < 8; ++j) {
            s = std::fma(float(dot(32 * j, 32)) * float(gb.sc[r][j]), dx[j], s);
            if (t != IQ4_XS) mn = std::fma(float(gb.mn[r][j]), sx[j], mn);
          }
          y = std::fma(s, gb.d[r], y);
          if (t != IQ4_XS) y = std::fma(-mn, gb.dmin[r], y);
        }
      }
    }
  }
}

#if SSD_FAST
// ---- the products: AVX-512 VNNI and AVX2 ---------------------------------------------------
// The block code below is written once over `V`, lanes of int32 or fp32 = rows of a group of 16:
// VL<0>, one zmm of all 16 with AVX-512; with AVX2, VW (two ymm) for up to 8 rows of x, and for
// more rows VL<0> and VL<1>, a ymm of rows 0-7 and one of rows 8-15, each block taken twice
// (group_tile), the second time from L1. Each lane's arithmetic is the same either way. A tile
// of NM <= MT rows of x passes over each group.
// Tuned per CPU vendor by build.py (timing only: no bit of a result depends on them): how far
// ahead the weight stream is prefetched, into which cache level, and how many groups of 16 rows
// a pass over one row of x reads side by side (SSD_M1_STREAMS; it also caps the 2 used for up
// to 4 rows: groups_per_pass, below).
#ifndef SSD_PF_BYTES
#define SSD_PF_BYTES 2048
#endif
#ifndef SSD_PF_L2
#define SSD_PF_L2 0
#endif
#ifndef SSD_M1_STREAMS
#define SSD_M1_STREAMS 4
#endif
constexpr int PF_BYTES = SSD_PF_BYTES;
// Into L1 (T0) or L2 only (T2): an L1 prefetch holds one of the core's few L1 miss buffers until
// its line arrives, and on an AMD EPYC that capped one core's weight stream near 12 GB/s.
#if SSD_FAST_X86
constexpr auto PF_HINT = SSD_PF_L2 ? _MM_HINT_T2 : _MM_HINT_T0;
static inline void prefetch_line(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), PF_HINT); }
#else
static inline void prefetch_line(const uint8_t* p) { __builtin_prefetch(p, 0, SSD_PF_L2 ? 2 : 3); }
#endif
// Software prefetch along the packed stream, one line per line read, PF_BYTES ahead (a hint:
// no fault past the end). Keeps DRAM busy while the cores compute.
static inline void ahead(const uint8_t* p) { prefetch_line(p + PF_BYTES); }
// The first PF_BYTES of a stretch about to be read, which no ahead() covers: fetched all at once
// rather than one demand miss after another (a thread starts such a stretch ~8 times per matrix,
// and a small draft matrix is only some 100 KB a thread).
static inline void warm(const uint8_t* p, int64_t bytes) {
  for (int64_t off = 0; off < std::min<int64_t>(bytes, PF_BYTES); off += 64) prefetch_line(p + off);
}

#if SSD_VNNI
template <int H> struct VL;  // H: which lanes of a group it holds (VNNI: all 16 in one pass)
template <>
struct VL<0> {
  using I = __m512i;
  using F = __m512;
  static constexpr int kPart = MT;  // rows of a tile a block function takes at once
  static constexpr bool kQ8Offset = true;  // Q8_0 goes in as w + 128 (unsigned): subtract 128 * sum x
  static I zero() { return _mm512_setzero_si512(); }
  static F zerof() { return _mm512_setzero_ps(); }
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I bytes(int8_t v) { return _mm512_set1_epi8(v); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I hi_nibbles(I a) { return _mm512_and_si512(_mm512_srli_epi16(a, 4), bytes(0x0F)); }
  template <int N> static I shl16(I a) { return _mm512_slli_epi16(a, N); }
  template <int N> static I shr16(I a) { return _mm512_srli_epi16(a, N); }
  static I or_bits45(I lo, I b) { return _mm512_ternarylogic_epi32(lo, b, bytes(0x30), 0xF8); }  // lo | (b & 0x30)
  static I add_where(I w, const uint8_t* bits, I v) {  // w + v in the bytes whose bit is set
    uint64_t m;
    std::memcpy(&m, bits, 8);
    return _mm512_mask_add_epi8(w, _cvtu64_mask64(m), w, v);
  }
  static I bcast(const void* p) { return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p)); }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static I table(const uint8_t* t16) { return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t16))); }
  static I lookup(I t, I idx) { return _mm512_shuffle_epi8(t, idx); }  // idx < 16 in every byte
  static I and32(I a, int32_t m) { return _mm512_and_si512(a, _mm512_set1_epi32(m)); }
  template <int N> static I shr32(I a) { return _mm512_srli_epi32(a, N); }
  static I dot(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }  // acc + 4 products per lane
  // A run of dot()s (see the AVX2 struct): VNNI sums straight into the 32-bit lanes.
  static I open(I acc) { return acc; }
  static I pdot(I run, I u, I s) { return dot(run, u, s); }
  static I close(I, I run) { return run; }
  static I dot_q8(I acc, I w, I x) { return _mm512_dpbusd_epi32(acc, w, x); }
  static I sub32(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I u8_to_32(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I s8_to_32(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F half(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F set1f(float v) { return _mm512_set1_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b, rounded once
  static void store(float* p, F a) { _mm512_storeu_ps(p, a); }
};
#elif SSD_NEON
template <int H>  // lanes (rows of the group) 4H .. 4H + 3: one 128-bit register
struct VL {
  using I = int8x16_t;  // 16 bytes, or 4 int32 lanes (vreinterpretq)
  using F = float32x4_t;
  static constexpr int kPart = 4;
  static constexpr bool kQ8Offset = false;  // SDOT is signed x signed: Q8_0 takes w as it is
  static int32x4_t i32(I a) { return vreinterpretq_s32_s8(a); }
  static I i8(int32x4_t a) { return vreinterpretq_s8_s32(a); }
  static uint8x16_t u8(I a) { return vreinterpretq_u8_s8(a); }
  static I zero() { return vdupq_n_s8(0); }
  static F zerof() { return vdupq_n_f32(0.f); }
  static I load(const uint8_t* p) { return vld1q_s8(reinterpret_cast<const int8_t*>(p + 16 * H)); }
  static I bytes(int8_t v) { return vdupq_n_s8(v); }
  static I and_(I a, I b) { return vandq_s8(a, b); }
  static I hi_nibbles(I a) { return vreinterpretq_s8_u8(vshrq_n_u8(u8(a), 4)); }
  template <int N> static I shl16(I a) { return vreinterpretq_s8_u16(vshlq_n_u16(vreinterpretq_u16_s8(a), N)); }
  template <int N> static I shr16(I a) { return vreinterpretq_s8_u16(vshrq_n_u16(vreinterpretq_u16_s8(a), N)); }
  static I or_bits45(I lo, I b) { return vorrq_s8(lo, vandq_s8(b, vdupq_n_s8(0x30))); }
  static I add_where(I w, const uint8_t* bits, I v) {  // bit i of the 16 at bits + 2H: byte i
    static const uint8_t one[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t b = vcombine_u8(vdup_n_u8(bits[2 * H]), vdup_n_u8(bits[2 * H + 1]));
    return vaddq_s8(w, vandq_s8(vreinterpretq_s8_u8(vtstq_u8(b, vld1q_u8(one))), v));
  }
  static I bcast(const void* p) { return i8(vdupq_n_s32(int32_t(rd32(static_cast<const uint8_t*>(p))))); }
  static I set1(int32_t v) { return i8(vdupq_n_s32(v)); }
  static I table(const uint8_t* t16) { return vreinterpretq_s8_u8(vld1q_u8(t16)); }
  static I lookup(I t, I idx) { return vreinterpretq_s8_u8(vqtbl1q_u8(u8(t), u8(idx))); }  // idx < 16
  static I and32(I a, int32_t m) { return i8(vandq_s32(i32(a), vdupq_n_s32(m))); }
  template <int N> static I shr32(I a) { return vreinterpretq_s8_u32(vshrq_n_u32(vreinterpretq_u32_s8(a), N)); }
  // acc + the 4 products of each lane's bytes: u's bytes are below 128 here (the callers'
  // weights: at most 63), so signed x signed is the unsigned x signed of the x86 code.
  static I dot(I acc, I u, I s) { return dot_s8(acc, u, s); }
  static I open(I acc) { return acc; }  // 32-bit sums throughout, as VNNI's
  static I pdot(I run, I u, I s) { return dot(run, u, s); }
  static I close(I, I run) { return run; }
  static I dot_q8(I acc, I w, I x) { return dot_s8(acc, veorq_s8(w, vdupq_n_s8(int8_t(0x80))), x); }  // w + 128 as stored
  static I dot_s8(I acc, I w, I x) {  // any signed bytes (|w| <= 128)
#if SSD_DOTPROD
    return i8(vdotq_s32(i32(acc), w, x));
#else
    const int16x8_t lo = vmull_s8(vget_low_s8(w), vget_low_s8(x)), hi = vmull_high_s8(w, x);
    return i8(vaddq_s32(i32(acc), vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi))));
#endif
  }
  static I sub32(I a, I b) { return i8(vsubq_s32(i32(a), i32(b))); }
  static I u8_to_32(const uint8_t* p) {
    return i8(vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vcreate_u8(rd32(p + 4 * H)))))));
  }
  static I s8_to_32(const uint8_t* p) {
    return i8(vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_u8(vcreate_u8(rd32(p + 4 * H)))))));
  }
  static F half(const uint8_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p + 8 * H)))); }
  static F cvt(I a) { return vcvtq_f32_s32(i32(a)); }
  static F set1f(float v) { return vdupq_n_f32(v); }
  static F mul(F a, F b) { return vmulq_f32(a, b); }
  static F fma(F a, F b, F c) { return vfmaq_f32(c, a, b); }
  static F fnma(F a, F b, F c) { return vfmsq_f32(c, a, b); }  // c - a * b, rounded once
  static void store(float* p, F a) { vst1q_f32(p + 4 * H, a); }
};
#else
template <int H>  // lanes (rows of the group) 8H .. 8H + 7
struct VL {
  // AVX2 has 16 ymm registers: a tile's accumulators for 16 lanes (two ymm a row) spilled.
  using I = __m256i;
  using F = __m256;
  static constexpr int kPart = 4;
  static constexpr bool kQ8Offset = false;  // maddubs would saturate on w + 128: Q8_0 uses signs
  static I zero() { return _mm256_setzero_si256(); }
  static F zerof() { return _mm256_setzero_ps(); }
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * H)); }
  static I bytes(int8_t v) { return _mm256_set1_epi8(v); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I hi_nibbles(I a) { return _mm256_and_si256(_mm256_srli_epi16(a, 4), _mm256_set1_epi8(0x0F)); }
  template <int N> static I shl16(I a) { return _mm256_slli_epi16(a, N); }
  template <int N> static I shr16(I a) { return _mm256_srli_epi16(a, N); }
  static I or_bits45(I lo, I b) { return _mm256_or_si256(lo, _mm256_and_si256(b, _mm256_set1_epi8(0x30))); }
  static __m256i bit_bytes(uint32_t x) {  // 0xFF in byte i where bit i of x is set
    const __m256i sel = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303);
    const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201));
    return _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(int32_t(x)), sel), bit), bit);
  }
  static I add_where(I w, const uint8_t* bits, I v) { return _mm256_add_epi8(w, _mm256_and_si256(bit_bytes(rd32(bits + 4 * H)), v)); }
  static I bcast(const void* p) { return _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(p)); }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static I table(const uint8_t* t16) { return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t16))); }
  static I lookup(I t, I idx) { return _mm256_shuffle_epi8(t, idx); }
  static I and32(I a, int32_t m) { return _mm256_and_si256(a, _mm256_set1_epi32(m)); }
  template <int N> static I shr32(I a) { return _mm256_srli_epi32(a, N); }
  // u8 x s8: two products to int16 (no saturation at the magnitudes used here: at most
  // 2 * 63 * 127), then pairs of those to int32.
  static I dot(I acc, I u, I s) { return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))); }
  // A run of dot()s summed in maddubs's 16-bit pair sums, widened to 32 bits once at close():
  // one multiply and one add a dot instead of two multiplies and an add. Exact (the same
  // integers) while the run's sum stays within int16: each caller bounds its run length by its
  // weights' range (the pair sums are at most 2 * wmax * 127).
  static I open(I) { return zero(); }
  static I pdot(I run, I u, I s) { return _mm256_add_epi16(run, _mm256_maddubs_epi16(u, s)); }
  static I close(I acc, I run) { return _mm256_add_epi32(acc, _mm256_madd_epi16(run, _mm256_set1_epi16(1))); }
  static I dot_q8(I acc, I w, I x) {  // w + 128 as stored: |w| times x with w's sign (|w| <= 128)
    const I ws = _mm256_xor_si256(w, _mm256_set1_epi8(int8_t(0x80)));
    return dot(acc, _mm256_abs_epi8(ws), _mm256_sign_epi8(x, ws));
  }
  static I sub32(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I u8_to_32(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * H))); }
  static I s8_to_32(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * H))); }
  static F half(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * H))); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F set1f(float v) { return _mm256_set1_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static void store(float* p, F a) { _mm256_storeu_ps(p + 8 * H, a); }
};
// Tiles of up to this many rows take all 16 lanes in one pass (VW), larger ones VL<0> then VL<1>
// in parts of 4 rows. Measured in one process against the one-pass code of before (tiles of 8):
// 1 or 2 halves were no faster at 3 to 5 rows (the second pass repeats the unpacking), the halves
// win at 9 rows (one pass over the weights instead of two; docs/kernels.md, "Accumulation order").
#ifndef SSD_VW_ROWS
#define SSD_VW_ROWS 8
#endif

// All 16 lanes as two ymm (rows 0-7, 8-15) in one pass, for tiles of up to SSD_VW_ROWS rows of x:
// each block is unpacked once.
struct VW {  // each operation is VL<0>'s on lanes 0-7 and VL<1>'s on lanes 8-15
  using L = VL<0>;
  using H = VL<1>;
  struct I { __m256i lo, hi; };
  struct F { __m256 lo, hi; };
  static constexpr int kPart = MT;
  static constexpr bool kQ8Offset = false;
  static I zero() { return {L::zero(), H::zero()}; }
  static F zerof() { return {L::zerof(), H::zerof()}; }
  static I load(const uint8_t* p) { return {L::load(p), H::load(p)}; }
  static I bytes(int8_t v) { return {L::bytes(v), H::bytes(v)}; }
  static I and_(I a, I b) { return {L::and_(a.lo, b.lo), H::and_(a.hi, b.hi)}; }
  static I hi_nibbles(I a) { return {L::hi_nibbles(a.lo), H::hi_nibbles(a.hi)}; }
  template <int N> static I shl16(I a) { return {L::template shl16<N>(a.lo), H::template shl16<N>(a.hi)}; }
  template <int N> static I shr16(I a) { return {L::template shr16<N>(a.lo), H::template shr16<N>(a.hi)}; }
  static I or_bits45(I lo, I b) { return {L::or_bits45(lo.lo, b.lo), H::or_bits45(lo.hi, b.hi)}; }
  static I add_where(I w, const uint8_t* bits, I v) { return {L::add_where(w.lo, bits, v.lo), H::add_where(w.hi, bits, v.hi)}; }
  static I bcast(const void* p) { return {L::bcast(p), H::bcast(p)}; }
  static I set1(int32_t v) { return {L::set1(v), H::set1(v)}; }
  static I table(const uint8_t* t16) { return {L::table(t16), H::table(t16)}; }
  static I lookup(I t, I idx) { return {L::lookup(t.lo, idx.lo), H::lookup(t.hi, idx.hi)}; }
  static I and32(I a, int32_t m) { return {L::and32(a.lo, m), H::and32(a.hi, m)}; }
  template <int N> static I shr32(I a) { return {L::template shr32<N>(a.lo), H::template shr32<N>(a.hi)}; }
  static I dot(I acc, I u, I s) { return {L::dot(acc.lo, u.lo, s.lo), H::dot(acc.hi, u.hi, s.hi)}; }
  static I open(I acc) { return {L::open(acc.lo), H::open(acc.hi)}; }
  static I pdot(I run, I u, I s) { return {L::pdot(run.lo, u.lo, s.lo), H::pdot(run.hi, u.hi, s.hi)}; }
  static I close(I acc, I run) { return {L::close(acc.lo, run.lo), H::close(acc.hi, run.hi)}; }
  static I dot_q8(I acc, I w, I x) { return {L::dot_q8(acc.lo, w.lo, x.lo), H::dot_q8(acc.hi, w.hi, x.hi)}; }
  static I sub32(I a, I b) { return {L::sub32(a.lo, b.lo), H::sub32(a.hi, b.hi)}; }
  static I u8_to_32(const uint8_t* p) { return {L::u8_to_32(p), H::u8_to_32(p)}; }
  static I s8_to_32(const uint8_t* p) { return {L::s8_to_32(p), H::s8_to_32(p)}; }
  static F half(const uint8_t* p) { return {L::half(p), H::half(p)}; }
  static F cvt(I a) { return {L::cvt(a.lo), H::cvt(a.hi)}; }
  static F set1f(float v) { return {L::set1f(v), H::set1f(v)}; }
  static F mul(F a, F b) { return {L::mul(a.lo, b.lo), H::mul(a.hi, b.hi)}; }
  static F fma(F a, F b, F c) { return {L::fma(a.lo, b.lo, c.lo), H::fma(a.hi, b.hi, c.hi)}; }
  static F fnma(F a, F b, F c) { return {L::fnma(a.lo, b.lo, c.lo), H::fnma(a.hi, b.hi, c.hi)}; }
  static void store(float* p, F a) { L::store(p, a.lo); H::store(p, a.hi); }
};
#endif

#if SSD_NEON
// All 16 lanes as four registers (rows 0-3, 4-7, 8-11, 12-15) in one pass: each operation is
// VL<h>'s on its quarter. A tile's rows go in parts of 4 (kPart): 16 accumulators of the 32
// registers.
struct VQ {
  using I = std::array<int8x16_t, 4>;
  using F = std::array<float32x4_t, 4>;
  static constexpr int kPart = 4;
  static constexpr bool kQ8Offset = false;
  template <class Fn> static auto each(Fn f) {  // f(h) for the quarters h = 0 .. 3
    return std::array{f(std::integral_constant<int, 0>{}), f(std::integral_constant<int, 1>{}),
                      f(std::integral_constant<int, 2>{}), f(std::integral_constant<int, 3>{})};
  }
  static I zero() { return each([](auto h) { return VL<h>::zero(); }); }
  static F zerof() { return each([](auto h) { return VL<h>::zerof(); }); }
  static I load(const uint8_t* p) { return each([&](auto h) { return VL<h>::load(p); }); }
  static I bytes(int8_t v) { return each([&](auto h) { return VL<h>::bytes(v); }); }
  static I and_(I a, I b) { return each([&](auto h) { return VL<h>::and_(a[h], b[h]); }); }
  static I hi_nibbles(I a) { return each([&](auto h) { return VL<h>::hi_nibbles(a[h]); }); }
  template <int N> static I shl16(I a) { return each([&](auto h) { return VL<h>::template shl16<N>(a[h]); }); }
  template <int N> static I shr16(I a) { return each([&](auto h) { return VL<h>::template shr16<N>(a[h]); }); }
  static I or_bits45(I lo, I b) { return each([&](auto h) { return VL<h>::or_bits45(lo[h], b[h]); }); }
  static I add_where(I w, const uint8_t* bits, I v) { return each([&](auto h) { return VL<h>::add_where(w[h], bits, v[h]); }); }
  static I bcast(const void* p) { return each([&](auto h) { return VL<h>::bcast(p); }); }
  static I set1(int32_t v) { return each([&](auto h) { return VL<h>::set1(v); }); }
  static I table(const uint8_t* t16) { return each([&](auto h) { return VL<h>::table(t16); }); }
  static I lookup(I t, I idx) { return each([&](auto h) { return VL<h>::lookup(t[h], idx[h]); }); }
  static I and32(I a, int32_t m) { return each([&](auto h) { return VL<h>::and32(a[h], m); }); }
  template <int N> static I shr32(I a) { return each([&](auto h) { return VL<h>::template shr32<N>(a[h]); }); }
  static I dot(I acc, I u, I s) { return each([&](auto h) { return VL<h>::dot(acc[h], u[h], s[h]); }); }
  static I open(I acc) { return acc; }
  static I pdot(I run, I u, I s) { return dot(run, u, s); }
  static I close(I, I run) { return run; }
  static I dot_q8(I acc, I w, I x) { return each([&](auto h) { return VL<h>::dot_q8(acc[h], w[h], x[h]); }); }
  static I sub32(I a, I b) { return each([&](auto h) { return VL<h>::sub32(a[h], b[h]); }); }
  static I u8_to_32(const uint8_t* p) { return each([&](auto h) { return VL<h>::u8_to_32(p); }); }
  static I s8_to_32(const uint8_t* p) { return each([&](auto h) { return VL<h>::s8_to_32(p); }); }
  static F half(const uint8_t* p) { return each([&](auto h) { return VL<h>::half(p); }); }
  static F cvt(I a) { return each([&](auto h) { return VL<h>::cvt(a[h]); }); }
  static F set1f(float v) { return each([&](auto h) { return VL<h>::set1f(v); }); }
  static F mul(F a, F b) { return each([&](auto h) { return VL<h>::mul(a[h], b[h]); }); }
  static F fma(F a, F b, F c) { return each([&](auto h) { return VL<h>::fma(a[h], b[h], c[h]); }); }
  static F fnma(F a, F b, F c) { return each([&](auto h) { return VL<h>::fnma(a[h], b[h], c[h]); }); }
  static void store(float* p, F a) { each([&](auto h) { VL<h>::store(p, a[h]); return 0; }); }
};
#endif

// One tile's activations from weight block b on: k-group kg of row m is 4 bytes at
// q + (kg * NM + m) * 4 (NM: the tile's rows); the per-block values of activation block j (of the weight block's
// block / 32) at d[j * MT + m], and so on; s16 per half block.
struct Tile {
  const int8_t* q;     // block b's first k-group
  const float* d;      // [block / 32][MT]
  const int32_t* sum;  // [block / 32][MT]
  const float* sx;     // [block / 32][MT]
  const int32_t* s16;  // [block / 16][MT]
  const float* hx;     // [block / 16][MT]

  Tile from(int m0) const { return {q + 4 * m0, d + m0, sum + m0, sx + m0, s16 + m0, hx + m0}; }  // rows m0 on
};

template <int BLOCK, int NM>
static inline Tile tile_at(const Act& a, int64_t tile, int64_t b) {
  const int64_t kgs = a.K / 4, kg0 = b * (BLOCK / 4), i = tile * a.nb + b * (BLOCK / AB);
  return {a.qt.data() + (tile * kgs * MT + kg0 * NM) * 4, a.dt.data() + i * MT, a.st.data() + i * MT,
          a.sxt.data() + i * MT, a.s16t.data() + 2 * i * MT, a.hxt.data() + 2 * i * MT};
}

// IQ4_NL's table as the kernel's Q8_0 code takes weights: w + 128, unsigned.
alignas(16) constexpr uint8_t KVALUES_U8[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

// Legacy types: one block of 32 weights (8 k-groups).
template <class V, int64_t T, int NM, int S>
static inline void legacy_block(const uint8_t* p, const Tile& x, typename V::F* acc) {
  using VI = typename V::I;
  using VF = typename V::F;
  constexpr bool has_m = T == Q4_1 || T == Q5_1, five = T == Q5_0 || T == Q5_1, signed8 = T == Q8_0 || T == IQ4_NL;
  constexpr int off = T == Q4_0 ? 8 : T == Q5_0 ? 16 : (signed8 && V::kQ8Offset) ? 128 : 0;
  const uint8_t* qs = p + (has_m ? 64 : 32);
  VI s[NM], run[NM];
  for (int m = 0; m < NM; ++m) run[m] = V::open(s[m] = V::zero());
#pragma GCC unroll 4
  for (int v = 0; v < 4; ++v) {
    VI w0, w1;
    if constexpr (T == Q8_0) {
      w0 = V::load(p + 32 + 128 * v);
      w1 = V::load(p + 32 + 128 * v + 64);
    } else {
      const VI raw = V::load(qs + 64 * v);
      w0 = V::and_(raw, V::bytes(0x0F));
      w1 = V::hi_nibbles(raw);
      if constexpr (five) {
        w0 = V::add_where(w0, qs + 256 + 16 * v, V::bytes(16));
        w1 = V::add_where(w1, qs + 256 + 16 * v + 8, V::bytes(16));
      }
      if constexpr (T == IQ4_NL) {
        const VI tab = V::table(KVALUES_U8);
        w0 = V::lookup(tab, w0);
        w1 = V::lookup(tab, w1);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < NM; ++m) {
      const VI x0 = V::bcast(x.q + ((2 * v) * S + m) * 4), x1 = V::bcast(x.q + ((2 * v + 1) * S + m) * 4);
      if constexpr (signed8) {
        s[m] = V::dot_q8(V::dot_q8(s[m], w0, x0), w1, x1);
      } else {
        run[m] = V::pdot(V::pdot(run[m], w0, x0), w1, x1);
      }
    }
    // Runs of 8 dots for 4-bit weights (8 * 2 * 15 * 127 = 30480), 4 for 5-bit (4 * 2 * 31 * 127 = 31496).
    if constexpr (!signed8)
      if (v == 3 || (five && v == 1))
        for (int m = 0; m < NM; ++m) {
          s[m] = V::close(s[m], run[m]);
          run[m] = V::open(s[m]);
        }
  }
  const VF d = V::half(p);
#pragma GCC unroll 8
  for (int m = 0; m < NM; ++m) {
    if constexpr (off != 0) s[m] = V::sub32(s[m], V::set1(off * x.sum[m]));
    acc[m] = V::fma(V::cvt(s[m]), V::mul(d, V::set1f(x.d[m])), acc[m]);
    if constexpr (has_m) acc[m] = V::fma(V::half(p + 32), V::set1f(x.sx[m]), acc[m]);
  }
}

// Q4_K / Q5_K / IQ4_XS: one super-block of 256 (8 sub-blocks of 8 k-groups, each an activation
// block). IQ4_XS's nibbles index the table (one byte shuffle), taken as Q8_0's w + 128.
template <class V, int64_t T, int NM, int S>
static inline void k4_block(const uint8_t* p, const Tile& x, typename V::F* acc) {
  using VI = typename V::I;
  using VF = typename V::F;
  constexpr bool nl = T == IQ4_XS;
  const VI tab = nl ? V::table(KVALUES_U8) : V::zero();
  VF s[NM];
  for (int m = 0; m < NM; ++m) s[m] = V::zerof();
#pragma GCC unroll 1
  for (int j = 0; j < 8; ++j) {
    const uint8_t* ch = p + k_head(T) + k_chunk(T) * j;  // 4 nibble vectors (Q5_K: then 8 masks)
    if constexpr (T == Q5_K) ahead(ch + 256);
    VI t[NM], run[NM];
    for (int m = 0; m < NM; ++m) run[m] = V::open(t[m] = V::zero());
#pragma GCC unroll 4
    for (int vv = 0; vv < 4; ++vv) {  // (a constant trip count: GCC unrolls it, accumulators stay put)
      const int v = 4 * j + vv;
      ahead(ch + 64 * vv);
      const VI raw = V::load(ch + 64 * vv);
      VI w0 = V::and_(raw, V::bytes(0x0F)), w1 = V::hi_nibbles(raw);
      if constexpr (T == Q5_K) {
        w0 = V::add_where(w0, ch + 256 + 16 * vv, V::bytes(16));
        w1 = V::add_where(w1, ch + 256 + 16 * vv + 8, V::bytes(16));
      }
      if constexpr (nl) {
        w0 = V::lookup(tab, w0);
        w1 = V::lookup(tab, w1);
      }
#pragma GCC unroll 8
      for (int m = 0; m < NM; ++m) {
        const VI x0 = V::bcast(x.q + ((2 * v) * S + m) * 4), x1 = V::bcast(x.q + ((2 * v + 1) * S + m) * 4);
        if constexpr (nl) t[m] = V::dot_q8(V::dot_q8(t[m], w0, x0), w1, x1);
        else run[m] = V::pdot(V::pdot(run[m], w0, x0), w1, x1);
      }
      // Runs of 8 dots for Q4_K (8 * 2 * 15 * 127 = 30480), 4 for Q5_K (4 * 2 * 31 * 127 = 31496).
      if constexpr (!nl)
        if (vv == 3 || (T == Q5_K && vv == 1))
          for (int m = 0; m < NM; ++m) {
            t[m] = V::close(t[m], run[m]);
            run[m] = V::open(t[m]);
          }
    }
    if constexpr (nl && V::kQ8Offset)
      for (int m = 0; m < NM; ++m) t[m] = V::sub32(t[m], V::set1(128 * x.sum[j * MT + m]));
    const VF sc = nl ? V::cvt(V::s8_to_32(p + 32 + 16 * j)) : V::cvt(V::u8_to_32(p + 64 + 16 * j));
#pragma GCC unroll 8
    for (int m = 0; m < NM; ++m) s[m] = V::fma(V::mul(V::cvt(t[m]), sc), V::set1f(x.d[j * MT + m]), s[m]);
  }
  const VF d = V::half(p);
#pragma GCC unroll 8
  for (int m = 0; m < NM; ++m) acc[m] = V::fma(s[m], d, acc[m]);
  if constexpr (nl) return;
  const VF dmin = V::half(p + 32);
  // The mins: each sub-block's min times the sum of x over it (sx), after the sums (fewer registers live).
  VF mn[NM];
  for (int m = 0; m < NM; ++m) mn[m] = V::zerof();
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    const VF mnj = V::cvt(V::u8_to_32(p + 192 + 16 * j));
#pragma GCC unroll 8
    for (int m = 0; m < NM; ++m) mn[m] = V::fma(mnj, V::set1f(x.sx[j * MT + m]), mn[m]);
  }
#pragma GCC unroll 8
  for (int m = 0; m < NM; ++m) acc[m] = V::fnma(mn[m], dmin, acc[m]);
}

// The K types of 16-wide sub-blocks (Q6_K, Q3_K, Q2_K): one super-block of 256, 16 sub-blocks
// of 4 k-groups, taken in pairs (activation blocks). The quants go in as stored, unsigned (Q6_K
// w + 32, Q3_K w + 4, Q2_K w), so a sub-block's sum starts from -32 or -4 times the sum of x
// over it (a broadcast load, where a subtraction would take a vector slot), or from 0.
// Q6_K: 2 nibble vectors and a plane of top bits a sub-block; Q3_K: a plane of low bits and 4
// k-groups' masks of third bits; Q2_K: its plane alone, and a min in each scale byte's high nibble.
template <class V, int64_t T>
static inline void sub_block_weights(const uint8_t* sub, typename V::I* w) {
  using VI = typename V::I;
  const VI hb = V::load(sub);
  if constexpr (T == Q6_K) {  // the top-bit plane (k-group c in bits 2c, 2c + 1, moved to bits 4, 5), 2 nibble vectors
    ahead(sub + 64);
    ahead(sub + 128);
    const VI raw0 = V::load(sub + 64), raw1 = V::load(sub + 128);
    w[0] = V::or_bits45(V::and_(raw0, V::bytes(0x0F)), V::template shl16<4>(hb));
    w[1] = V::or_bits45(V::hi_nibbles(raw0), V::template shl16<2>(hb));
    w[2] = V::or_bits45(V::and_(raw1, V::bytes(0x0F)), hb);
    w[3] = V::or_bits45(V::hi_nibbles(raw1), V::template shr16<2>(hb));
  } else {
    const VI three = V::bytes(3);
    w[0] = V::and_(hb, three);
    w[1] = V::and_(V::template shr16<2>(hb), three);
    w[2] = V::and_(V::template shr16<4>(hb), three);
    w[3] = V::and_(V::template shr16<6>(hb), three);
    if constexpr (T == Q3_K) {
      ahead(sub + 64);
      for (int c = 0; c < 4; ++c) w[c] = V::add_where(w[c], sub + 64 + 8 * c, V::bytes(4));
    }
  }
}

template <class V, int64_t T, int NM, int S>
static inline void k16_block(const uint8_t* p, const Tile& x, typename V::F* acc) {
  using VI = typename V::I;
  using VF = typename V::F;
  constexpr int sub_bytes = T == Q6_K ? 192 : T == Q3_K ? 96 : 64;
  const VF d = V::half(p);
  VF s[NM];  // Q2_K: the scales' partial sum
  for (int m = 0; m < NM; ++m) s[m] = V::zerof();
#pragma GCC unroll 1
  for (int pr = 0; pr < 8; ++pr) {
    VF sp[NM];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const int j = 2 * pr + h;
      VI t[NM];
      VI run[NM];
      for (int m = 0; m < NM; ++m) {
        t[m] = T == Q2_K ? V::zero() : V::set1(T == Q6_K ? x.s16[j * MT + m] : x.s16[j * MT + m] / 8);
        run[m] = V::open(t[m]);
      }
      const uint8_t* sub = p + k_head(T) + sub_bytes * j;
      ahead(sub);
      VI w[4];
      sub_block_weights<V, T>(sub, w);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
#pragma GCC unroll 8
        for (int m = 0; m < NM; ++m) run[m] = V::pdot(run[m], w[c], V::bcast(x.q + ((4 * j + c) * S + m) * 4));
        // Runs of 2 dots for Q6_K (2 * 2 * 63 * 127 = 32004), 4 for Q3_K and Q2_K (4 * 2 * 7 * 127 = 7112).
        if (c == 3 || (T == Q6_K && c == 1))
          for (int m = 0; m < NM; ++m) {
            t[m] = V::close(t[m], run[m]);
            run[m] = V::open(t[m]);
          }
      }
      const VF sc = T == Q2_K ? V::cvt(V::and32(V::u8_to_32(p + 64 + 16 * j), 0x0F)) : V::cvt(V::s8_to_32(p + 32 + 16 * j));
#pragma GCC unroll 8
      for (int m = 0; m < NM; ++m) {
        const VF tf = V::cvt(t[m]);
        sp[m] = h == 0 ? V::mul(tf, sc) : V::fma(tf, sc, sp[m]);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < NM; ++m) {
      if constexpr (T == Q2_K) s[m] = V::fma(sp[m], V::set1f(x.d[pr * MT + m]), s[m]);
      else acc[m] = V::fma(sp[m], V::mul(d, V::set1f(x.d[pr * MT + m])), acc[m]);
    }
  }
  if constexpr (T == Q2_K) {
    const VF dmin = V::half(p + 32);
#pragma GCC unroll 8
    for (int m = 0; m < NM; ++m) acc[m] = V::fma(s[m], d, acc[m]);
    VF mn[NM];  // the mins: each sub-block's min times its half block's dx * sum(q)
    for (int m = 0; m < NM; ++m) mn[m] = V::zerof();
#pragma GCC unroll 4
    for (int j = 0; j < 16; ++j) {
      const VF mnj = V::cvt(V::template shr32<4>(V::u8_to_32(p + 64 + 16 * j)));
#pragma GCC unroll 8
      for (int m = 0; m < NM; ++m) mn[m] = V::fma(mnj, V::set1f(x.hx[j * MT + m]), mn[m]);
    }
#pragma GCC unroll 8
    for (int m = 0; m < NM; ++m) acc[m] = V::fnma(mn[m], dmin, acc[m]);
  }
}

// Rows NM0 .. NM - 1 of an NM-row tile on one block, in parts of at most V::kPart rows.
template <class V, int64_t T, int NM, int NM0 = 0>
static inline void block(const uint8_t* p, const Tile& x, typename V::F* acc) {
  constexpr int n = std::min(V::kPart, NM - NM0);
  const Tile part = x.from(NM0);
  if constexpr (T == Q4_K || T == Q5_K || T == IQ4_XS) k4_block<V, T, n, NM>(p, part, acc + NM0);
  else if constexpr (T == Q6_K || T == Q3_K || T == Q2_K) k16_block<V, T, n, NM>(p, part, acc + NM0);
  else legacy_block<V, T, n, NM>(p, part, acc + NM0);
  if constexpr (NM0 + n < NM) block<V, T, NM, NM0 + n>(p, x, acc);
}

// NG groups side by side, block by block: each group is a stream of its own in memory, and
// several streams at once keep more of DRAM's latency covered than one (the hardware
// prefetcher follows each), and give the core independent chains to overlap.
template <int64_t T, int NM, int NG, class LA, class LB, bool TWO>
static void group_tile_lanes(const uint8_t* packed, int64_t stride, int64_t nb, const Act& a, int64_t tile, float* out) {
  constexpr int pb = T == Q4_0 || T == IQ4_NL ? 288 : T == Q4_1 ? 320 : T == Q5_0 ? 352 : T == Q5_1 ? 384
                   : T == Q8_0 ? 544 : T == Q4_K ? 2368 : T == Q5_K ? 2880 : T == Q6_K ? 3360 : T == Q2_K ? 1344
                   : T == Q3_K ? 1824 : 2208;
  // acc0: the lanes of LA; acc1: those of LB where TWO (LB's pass follows LA's on each block).
  typename LA::F acc0[NG][NM];
  typename LB::F acc1[NG][NM];
  for (int g = 0; g < NG; ++g)
    for (int m = 0; m < NM; ++m) {
      acc0[g][m] = LA::zerof();
      acc1[g][m] = LB::zerof();
    }
  for (int64_t b = 0; b < nb; ++b) {
    const Tile x = tile_at<(T == Q2_K || T == Q3_K || T == Q4_K || T == Q5_K || T == Q6_K || T == IQ4_XS) ? 256 : 32,
                           NM>(a, tile, b);
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g) {
      const uint8_t* p = packed + g * stride + b * pb;
      if constexpr (pb < 1024) {  // a small legacy block: all of its lines
#pragma GCC unroll 16
        for (int off = 0; off < pb; off += 64) ahead(p + off);
      } else {  // the scales (the quants are fetched ahead as they are read)
#pragma GCC unroll 5
        for (int off = 0; off < k_head(T); off += 64) ahead(p + off);
      }
      block<LA, T, NM>(p, x, acc0[g]);
      if constexpr (TWO) block<LB, T, NM>(p, x, acc1[g]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int m = 0; m < NM; ++m) {
      LA::store(out + (g * a.M + tile * MT + m) * G, acc0[g][m]);
      if constexpr (TWO) LB::store(out + (g * a.M + tile * MT + m) * G, acc1[g][m]);
    }
}

// Lane sets: VNNI all 16 lanes in one zmm; AVX2 up to SSD_VW_ROWS rows of x over all 16 as two
// ymm (VW), more rows in two passes of 8 lanes (VL<0>, VL<1>) in parts of 4 rows; NEON all 16
// as four registers (VQ) in parts of 4 rows.
template <int64_t T, int NM, int NG>
static void group_tile(const uint8_t* packed, int64_t stride, int64_t nb, const Act& a, int64_t tile, float* out) {
#if SSD_VNNI
  group_tile_lanes<T, NM, NG, VL<0>, VL<0>, false>(packed, stride, nb, a, tile, out);
#elif SSD_NEON
  group_tile_lanes<T, NM, NG, VQ, VQ, false>(packed, stride, nb, a, tile, out);
#else
  if constexpr (NM <= SSD_VW_ROWS) group_tile_lanes<T, NM, NG, VW, VW, false>(packed, stride, nb, a, tile, out);
  else group_tile_lanes<T, NM, NG, VL<0>, VL<1>, true>(packed, stride, nb, a, tile, out);
#endif
}

// Groups per pass by rows of x: up to as many streams as the registers hold accumulators for.
// (Several streams keep more DRAM requests in flight on the Intel Xeon; on an AMD EPYC one
// sequential stream per thread, which its prefetchers follow, is faster.)
static int groups_per_pass(int64_t M) { return M == 1 ? SSD_M1_STREAMS : M <= 4 ? std::min(2, SSD_M1_STREAMS) : 1; }

// A tile of NM rows over ng groups: side by side as groups_per_pass allows, else one at a time.
template <int64_t T, int NM>
static void tile_groups(const uint8_t* packed, int64_t stride, int64_t ng, int64_t nb, const Act& a, int64_t t, float* out) {
  if constexpr (NM == 1) {
    if (ng == 4) return group_tile<T, 1, 4>(packed, stride, nb, a, t, out);
    if (ng == 3) return group_tile<T, 1, 3>(packed, stride, nb, a, t, out);
  }
  if constexpr (NM <= 4)
    if (ng == 2) return group_tile<T, NM, 2>(packed, stride, nb, a, t, out);
  for (int64_t g = 0; g < ng; ++g) group_tile<T, NM, 1>(packed + g * stride, stride, nb, a, t, out + g * a.M * G);
}

template <int64_t T, int NM = 1>
static void tile_of(int64_t rows, const uint8_t* packed, int64_t stride, int64_t ng, int64_t nb, const Act& a, int64_t t, float* out) {
  if constexpr (NM < MT)
    if (rows > NM) return tile_of<T, NM + 1>(rows, packed, stride, ng, nb, a, t, out);
  tile_groups<T, NM>(packed, stride, ng, nb, a, t, out);
}

template <int64_t T>
static void group_simd(const uint8_t* packed, int64_t ng, int64_t nb, const Act& a, int64_t M, float* out) {
  const int64_t stride = nb * info(T).pack_bytes;
  for (int64_t t = 0; t * MT < M; ++t) tile_of<T>(tile_rows(M, t), packed, stride, ng, nb, a, t, out);
}

static void group_fast(int64_t t, const uint8_t* packed, int64_t ng, int64_t nb, const Act& a, int64_t M, float* out) {
  switch (t) {
    case Q4_0: group_simd<Q4_0>(packed, ng, nb, a, M, out); break;
    case Q4_1: group_simd<Q4_1>(packed, ng, nb, a, M, out); break;
    case Q5_0: group_simd<Q5_0>(packed, ng, nb, a, M, out); break;
    case Q5_1: group_simd<Q5_1>(packed, ng, nb, a, M, out); break;
    case Q8_0: group_simd<Q8_0>(packed, ng, nb, a, M, out); break;
    case Q4_K: group_simd<Q4_K>(packed, ng, nb, a, M, out); break;
    case Q5_K: group_simd<Q5_K>(packed, ng, nb, a, M, out); break;
    case Q6_K: group_simd<Q6_K>(packed, ng, nb, a, M, out); break;
    case IQ4_NL: group_simd<IQ4_NL>(packed, ng, nb, a, M, out); break;
    case Q2_K: group_simd<Q2_K>(packed, ng, nb, a, M, out); break;
    case Q3_K: group_simd<Q3_K>(packed, ng, nb, a, M, out); break;
    case IQ4_XS: group_simd<IQ4_XS>(packed, ng, nb, a, M, out); break;
  }
}
#else
static int groups_per_pass(int64_t) { return 1; }
static void warm(const uint8_t*, int64_t) {}
static void group_fast(int64_t t, const uint8_t* packed, int64_t, int64_t nb, const Act& a, int64_t M, float* out) {
  group_portable(t, packed, nb, a, M, out);
}
#endif

// ---- the ops -------------------------------------------------------------------------------
// Checks part p (packed [groups * nb * pack_bytes] of type types[p], rows[p] rows of K) and
// returns its group count.
static int64_t check_part(const at::Tensor& part, int64_t type, int64_t rows, int64_t K, size_t p) {
  TORCH_CHECK(known(type), "ssd qlinear: unsupported GGUF type ", type);
  const Info in = info(type);
  TORCH_CHECK(K % in.block == 0, "ssd qlinear: K = ", K, " is not a multiple of ", in.block);
  const int64_t groups = (rows + G - 1) / G;
  TORCH_CHECK(part.scalar_type() == at::kByte && part.is_contiguous() && part.numel() == groups * (K / in.block) * in.pack_bytes,
              "ssd qlinear: part ", p, " is not a packed tensor of ", rows, " x ", K);
  return groups;
}

static void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.size(1) == K &&
                  (x.stride(1) == 1 || K <= 1),
              "ssd qlinear: x must be fp32 [M, K] on the CPU with contiguous rows");
}

// Where part p's outputs go: row m, its row r -> y[p][m * ld[p] + col[p] + r] (+ bias[col[p] + r]).
struct Outputs {
  std::vector<float*> y;
  std::vector<int64_t> ld, col;
  const float* bias = nullptr;
};

// The products of every part, part p on the activations acts[p], its groups shared among the
// threads in runs of consecutive groups. Threads take runs of groups that lie back to back in
// memory: each thread reads one long stream that its prefetches (and the hardware's) run ahead
// in. A few runs per thread, handed out dynamically, so a thread slowed by a busy core takes fewer.
static void run_parts(const std::vector<const Act*>& acts, at::TensorList parts, at::IntArrayRef types,
                      at::IntArrayRef rows, int64_t K, const Outputs& o, bool reference) {
  std::vector<int64_t> groups_before = {0};
  int64_t scratch = 0;  // floats of one pass's output, for the part that needs most
  for (size_t p = 0; p < parts.size(); ++p) {
    groups_before.push_back(groups_before.back() + check_part(parts[p], types[p], rows[p], K, p));
    scratch = std::max(scratch, groups_per_pass(acts[p]->M) * acts[p]->M * G);
  }
  const int64_t total = groups_before.back();
  if (scratch == 0 || total == 0) return;
  // A thread per few groups at least: waking threads for a small matrix costs more than it saves.
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total / MIN_GROUPS_PER_THREAD));
  const int64_t run = std::max<int64_t>(1, (total + 4 * nt - 1) / (4 * nt));
  std::atomic<int64_t> next{0};
  auto body = [&](int64_t, int64_t) {
    std::vector<float> out(scratch);  // [group of the pass][M][G]
    for (;;) {
      const int64_t u0 = next.fetch_add(run, std::memory_order_relaxed);
      if (u0 >= total) break;
      const int64_t u1 = std::min(total, u0 + run);
      size_t p = 0, warmed = parts.size();
      for (int64_t u = u0; u < u1;) {
        while (groups_before[p + 1] <= u) ++p;
        const Act& a = *acts[p];
        const int64_t M = a.M;
        // The next groups of this part in the run, done in one pass.
        const int64_t g = u - groups_before[p], ng = std::min<int64_t>({groups_per_pass(M), u1 - u, groups_before[p + 1] - u});
        const int64_t t = types[p];
        const Info in = info(t);
        const int64_t nb = K / in.block;
        const uint8_t* packed = parts[p].data_ptr<uint8_t>() + g * nb * in.pack_bytes;
        if (warmed != p) {  // this run's stretch of part p starts here
          warm(packed, (std::min(u1, groups_before[p + 1]) - u) * nb * in.pack_bytes);
          warmed = p;
        }
        if (reference)
          for (int64_t i = 0; i < ng; ++i) group_portable(t, packed + i * nb * in.pack_bytes, nb, a, M, out.data() + i * M * G);
        else group_fast(t, packed, ng, nb, a, M, out.data());
        for (int64_t i = 0; i < ng; ++i) {
          const int64_t n0 = (g + i) * G, valid = std::min<int64_t>(G, rows[p] - n0);
          for (int64_t m = 0; m < M; ++m)
            for (int64_t r = 0; r < valid; ++r) {
              float v = out[(i * M + m) * G + r];
              if (o.bias) v = v + o.bias[o.col[p] + n0 + r];
              o.y[p][m * o.ld[p] + o.col[p] + n0 + r] = v;
            }
        }
        u += ng;
      }
    }
  };
  if (nt <= 1) body(0, 1);
  else at::parallel_for(0, nt, 1, body);
}

at::Tensor qlinear(const at::Tensor& x, at::TensorList parts, at::IntArrayRef types, at::IntArrayRef rows,
                   int64_t K, const std::optional<at::Tensor>& bias, bool reference) {
  check_x(x, K);
  TORCH_CHECK(parts.size() == types.size() && types.size() == rows.size() && !parts.empty(),
              "ssd qlinear: one type and row count per part");
  const int64_t M = x.size(0);
  int64_t N = 0;
  Outputs o;
  for (size_t p = 0; p < parts.size(); ++p) {
    o.col.push_back(N);
    N += rows[p];
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "ssd qlinear: bad bias");
    o.bias = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, at::kFloat);
  if (M == 0) return y;
  // This thread's, kept so its buffers' capacity serves call after call. (A reference: the
  // worker threads must see this one, not their own thread_local.)
  static thread_local Act kept;
  quantize_act(x.data_ptr<float>(), x.stride(0), M, K, kept);
  o.y.assign(parts.size(), y.data_ptr<float>());
  o.ld.assign(parts.size(), N);
  run_parts(std::vector<const Act*>(parts.size(), &kept), parts, types, rows, K, o, reference);
  return y;
}

// Each part on its own activations: y[i] = xs[i] @ parts[i].T, all in one parallel pass (a
// mixture's down projections, one an expert, each on its own rows). Each output has the bits
// qlinear gives it alone: the same activation quantisation, the same per-group arithmetic.
std::vector<at::Tensor> qlinear_each(at::TensorList xs, at::TensorList parts, at::IntArrayRef types,
                                     at::IntArrayRef rows, int64_t K) {
  TORCH_CHECK(xs.size() == parts.size() && parts.size() == types.size() && types.size() == rows.size(),
              "ssd qlinear_each: one x, type and row count per part");
  std::vector<Act> acts(xs.size());
  std::vector<const Act*> ptrs;
  std::vector<at::Tensor> ys;
  Outputs o;
  for (size_t i = 0; i < xs.size(); ++i) {
    check_x(xs[i], K);
    quantize_act(xs[i].data_ptr<float>(), xs[i].stride(0), xs[i].size(0), K, acts[i]);
    ptrs.push_back(&acts[i]);
    ys.push_back(at::empty({xs[i].size(0), rows[i]}, at::kFloat));
    o.y.push_back(ys.back().data_ptr<float>());
    o.ld.push_back(rows[i]);
    o.col.push_back(0);
  }
  run_parts(ptrs, parts, types, rows, K, o, false);
  return ys;
}

// The activation quantisation, for tests: (q int8 [M, K], d fp32 [M, K / 32]).
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) % AB == 0,
              "ssd quant: bad activations");
  Act a;
  quantize_act(x.data_ptr<float>(), x.size(1), x.size(0), x.size(1), a);
  at::Tensor q = at::empty({x.size(0), x.size(1)}, at::kChar), d = at::empty({x.size(0), a.nb}, at::kFloat);
  std::memcpy(q.data_ptr<int8_t>(), a.q.data(), a.q.size());
  std::memcpy(d.data_ptr<float>(), a.d.data(), a.d.size() * 4);
  return {q, d};
}

// GGUF Q4_0 blocks of fp32 rows (a draft requantised to 4.5 bits a weight), bit for bit as ggml's
// reference quantiser and the gguf package make them: per 32 weights, v = the first value of the
// largest magnitude, d = v / -8 (stored as fp16), q_i = min(15, trunc(x_i * (1 / d) + 8.5)).
at::Tensor quantize_q4_0(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(1) % 32 == 0,
              "ssd quant: Q4_0 needs contiguous fp32 rows of a multiple of 32 weights");
  const int64_t N = w.size(0), nb = w.size(1) / 32;
  at::Tensor out = at::empty({N, nb * 18}, at::kByte);
  const float* src = w.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, N * nb, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* v = src + 32 * b;
      uint8_t* o = dst + 18 * b;
      float amax = 0.f;  // no data-dependent branch per weight: this runs over a whole model at load
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
      int first = 0;
      while (first < 31 && std::fabs(v[first]) != amax) ++first;
      const float d = v[first] / -8.f, inv = d != 0.f ? 1.f / d : 0.f;
      const uint16_t h = c10::detail::fp16_ieee_from_fp32_value(d);
      std::memcpy(o, &h, 2);
      auto q = [&](float x) { return std::min(15, int(std::trunc(x * inv + 8.5f))); };
      for (int i = 0; i < 16; ++i) o[2 + i] = uint8_t(q(v[i]) | (q(v[i + 16]) << 4));
    }
  });
  return out;
}

int64_t packed_bytes(int64_t type, int64_t N, int64_t K) {
  TORCH_CHECK(known(type), "ssd quant: unsupported GGUF type ", type);
  const Info in = info(type);
  return (N + G - 1) / G * (K / in.block) * in.pack_bytes;
}

}  // namespace

SSD_LIBRARY(m) {
  m.def("repack(Tensor raw, int type, int N, int K) -> Tensor");
  m.def("qlinear(Tensor x, Tensor[] parts, int[] types, int[] rows, int K, Tensor? bias, bool reference) -> Tensor");
  m.def("qlinear_each(Tensor[] xs, Tensor[] parts, int[] types, int[] rows, int K) -> Tensor[]");
  m.def("dequant_rows(Tensor raw, int type, Tensor ids, int K) -> Tensor");
  m.def("quantize_rows(Tensor x) -> (Tensor, Tensor)");
  m.def("quantize_q4_0(Tensor w) -> Tensor");
  m.def("packed_bytes(int type, int N, int K) -> int", &packed_bytes);
  m.impl("repack", c10::DispatchKey::CPU, &repack);
  m.impl("qlinear", c10::DispatchKey::CPU, &qlinear);
  m.impl("qlinear_each", c10::DispatchKey::CPU, &qlinear_each);
  m.impl("dequant_rows", c10::DispatchKey::CPU, &dequant_rows);
  m.impl("quantize_rows", c10::DispatchKey::CPU, &quantize_rows);
  m.impl("quantize_q4_0", c10::DispatchKey::CPU, &quantize_q4_0);
}
