#pragma once

// The a8 kernels' tiles (included by a8_linear.cpp and gguf_linear.cpp): GGUF-style block-quantized
// weights (Q4_1 and Q8_0 blocks of 32 inputs, and a GGUF file's own blocks) times activations quantized to
// int8 per block of 32, with integer dot products (AVX512-VNNI ``vpdpbusd``): llama.cpp's arithmetic on its
// CPU path, row-invariant by construction.
//
// Why this exists: the bfloat16-activation kernels (quant_linear.cpp, PyTorch's bits) dequantize every
// weight to float32 and spend two multiply-adds and a table lookup on it; on a 2-core Xeon the 30
// layers' int4 projections then take ~7 ms a token while llama.cpp decodes the same GGUF in 11.3 ms
// in all. Quantizing each activation row to int8 once per call and summing 64 int4 x int8 products
// per instruction does ~5x less work per weight. The integer sums are exact, so the per-row result is
// decided by the per-block float steps alone, which run in one fixed order whatever the row count.
//
// Arithmetic, for a row x of K features and output o, blocks b of 32 features:
//
//   amax = max |x[32b .. 32b + 31]|;  dx = amax / 127;  id = dx != 0 ? 1 / dx : 0
//   qx[k] = round_half_even(x[k] * id)               (int8; |qx| <= 127)
//   sx = dx * float(sum_k qx[k])
//   w4a8: weight w[o, k] = dw[o, b] * q[o, k] + mw[o, b], q in 0..15 (Q4_1); dw, mw float16
//         acc = acc + (dw * dx) * float(sum_k q[o, k] qx[k]);  acc = acc + mw * sx
//   w8a8: weight w[o, k] = dw[o, b] * q[o, k], q in -127..127 (Q8_0); dw float16
//         acc = acc + (dw * dx) * float(sum_k q[o, k] qx[k])
//
// A GGUF file's own blocks (models/quant/gguf_blocks.py, --quantization gguf) run in two tiles, their
// scales held as the file holds them: the legacy types' float16 d (and m) per 32 inputs, a K-quant's
// int8 sub-block codes sc per 16 or 32 inputs times the float16 d of its 256-input super-block, the
// product float(d) * float(sc) formed in the kernel (exact in float32: 11 + 7 bits of mantissa, so the
// same bits as a float32 scale computed beforehand; float32 scales remain for anything else):
//   nibble tile: codes c in 0 .. 2^bits - 1 stored as a nibble plus 0-2 high bit planes, an integer
//         offset o (the weight is scale * (c - o) [+ mw]), a scale per SUB = 32 or 16 inputs, optional
//         mins mw per 32; per sub-block s of block b in order:
//         acc = acc + (dw[o, s] * dx) * float(sum_{k in s} c qx - o * sum_{k in s} qx)
//         then, with mins, acc = acc + mw[o, b] * sx.
//     Q4_0 / Q4_1 / Q4_K (4 bits, mins), Q5_1 / Q5_K (5 bits, mins), Q5_0 (5 bits, o = 16),
//     Q3_K (3 bits, o = 4, SUB 16), Q6_K (6 bits, o = 32, SUB 16). w4a8 is its 4-bit case with float16
//     d and m interleaved (above); the offset's product is an exact integer, so for every type
//     the sums equal those of the signed codes (c - o) times qx.
//   w8 tile with float32 scales: Q8_0.
// The activations are quantized per block of 32 as above for every type (llama.cpp quantizes them per
// 256 for its K-quants, Q8_K: a coarser scale; the weights are the file's either way).
//
// with acc from 0 over b in order, each step a float32 multiply or add (built with -ffp-contract=off,
// so none is fused), and y = acc in float32. tests/models/test_a8_linear.py holds the kernels to a
// PyTorch rendering of these lines bit for bit.
//
// Layouts (16 outputs per panel; P = N / 16, KB = K / 32):
//   w4: packed [P, K / 8, 64] uint8: at octet j (features 8j .. 8j + 7), byte 4o + t holds
//       q[16p + o, 8j + t] (low nibble) and q[16p + o, 8j + 4 + t] (high nibble);
//       dm [P, KB, 2, 16] float16: dw then mw of the panel's 16 outputs.
//   w8: packed [P, K / 4, 64] int8: at quad j, byte 4o + t holds q[16p + o, 4j + t];
//       scales [P, KB, 16] float16 or float32; corr of that shape int32 = 128 * sum of the block's q (vpdpbusd
//       multiplies unsigned by signed bytes: the activations enter as qx + 128, and the correction
//       takes the 128s back out, exactly).
//   nibble tile: packed as w4; high [P, K / 8, HB, 2, 8] uint8: for octet j, plane h (bit 4 + h of the
//       code) and half (the low / high nibbles' vector), 64 bits, bit 4o + t that of the byte at 4o + t;
//       scales [P, K / SUB, 16] and mins [P, KB, 16] float32 or float16, or int8 codes with
//       scale_super / min_super [P, K / 256, 16] float16 (the value: super * code).
//
// Worked example (w4a8, K = 32, one output; q = 1 everywhere, dw = 0.5, mw = -1, so w = -0.5; x = 2
// everywhere): dx = 2 / 127, qx = 127, sx = dx * 4064 = 64; acc = (0.5 dx) * 4064 + (-1) * 64 = -32,
// which is sum w * x exactly.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

namespace tidespec_a8 {

constexpr int64_t BLOCK = 32;  // features per weight and activation block
constexpr int64_t OUTS = 16;  // outputs per panel (one zmm of int32 / float32)
constexpr int64_t ROW_GROUP = 5;  // most rows sharing an unpacked weight vector (a gamma-4 verification)

#if defined(CPU_CAPABILITY_AVX512)
#define A8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))

inline bool vnni_here() { return __builtin_cpu_supports("avx512vnni"); }

// One row's activations: x [K] float32 -> qx [K] int8 (plus `offset`: 0, or 128 for the unsigned
// operand of w8a8), dx [KB], sx [KB], qs16 [K / 16] (integer sums of qx per 16 inputs).
A8_TARGET inline void quantize_row(const float* x, int64_t K, uint8_t offset, uint8_t* qx, float* dx, float* sx,
                            int32_t* qs16) {
  const __m512 sign_off = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < K / BLOCK; ++b) {
    const __m512 v0 = _mm512_loadu_ps(x + b * BLOCK), v1 = _mm512_loadu_ps(x + b * BLOCK + 16);
    const __m512 a = _mm512_max_ps(_mm512_and_ps(v0, sign_off), _mm512_and_ps(v1, sign_off));
    const float amax = _mm512_reduce_max_ps(a);
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const __m512 idv = _mm512_set1_ps(id);
    // cvtps_epi32 rounds to nearest even (the default MXCSR mode), as torch.round does
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, idv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, idv));
    const __m512i lim = _mm512_set1_epi32(127), neg = _mm512_set1_epi32(-127);
    const __m512i c0 = _mm512_max_epi32(_mm512_min_epi32(q0, lim), neg), c1 = _mm512_max_epi32(_mm512_min_epi32(q1, lim), neg);
    const int s0 = _mm512_reduce_add_epi32(c0), s1 = _mm512_reduce_add_epi32(c1), sum = s0 + s1;
    const __m128i o = _mm_set1_epi8(static_cast<char>(offset));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + b * BLOCK), _mm_add_epi8(_mm512_cvtepi32_epi8(c0), o));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + b * BLOCK + 16), _mm_add_epi8(_mm512_cvtepi32_epi8(c1), o));
    dx[b] = d;
    sx[b] = d * static_cast<float>(sum);
    qs16[2 * b] = s0;
    qs16[2 * b + 1] = s1;
  }
}

struct Rows {  // the call's activations, quantized once
  std::vector<uint8_t> q;  // [R, K]
  std::vector<float> d, s;  // [R, KB]
  std::vector<int32_t> qs16;  // [R, K / 16]
};

inline Rows quantize_rows(const float* x, int64_t R, int64_t K, uint8_t offset) {
  Rows rows{std::vector<uint8_t>(R * K), std::vector<float>(R * (K / BLOCK)), std::vector<float>(R * (K / BLOCK)),
            std::vector<int32_t>(R * (K / 16))};
  for (int64_t r = 0; r < R; ++r) {
    quantize_row(x + r * K, K, offset, rows.q.data() + r * K, rows.d.data() + r * (K / BLOCK),
                 rows.s.data() + r * (K / BLOCK), rows.qs16.data() + r * (K / 16));
  }
  return rows;
}

inline int32_t quad(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// 16 block scales of a panel as float32: GGUF's float16 (Q4_1 / Q8_0 as w4a8 / w8a8 pack them) or float32.
A8_TARGET inline __m512 load16(const c10::Half* s) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
}
A8_TARGET inline __m512 load16(const float* s) { return _mm512_loadu_ps(s); }

// The accumulators of a tile, zeroed; a tile's float32 sums stored to y.
template <int R, int PN>
inline void zero(__m512 (&acc)[R][PN]) {
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < PN; ++p) {
      acc[r][p] = _mm512_setzero_ps();
    }
  }
}

template <int R, int PN, int H>
inline void zero(__m512i (&isum)[R][PN][H]) {
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < PN; ++p) {
      for (int h = 0; h < H; ++h) {
        isum[r][p][h] = _mm512_setzero_si512();
      }
    }
  }
}

template <int R, int PN>
inline void store(const __m512 (&acc)[R][PN], int64_t p0, int64_t r0, float* y, int64_t ldy) {
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < PN; ++p) {
      _mm512_storeu_ps(y + (r0 + r) * ldy + (p0 + p) * OUTS, acc[r][p]);
    }
  }
}

// Where a nibble tile's weights live: the 16 scales of panel p's sub-block u at scales + p * panel_s +
// u * s_stride, its mins of block b at mins + p * panel_m + b * m_stride (w4a8 interleaves d and m);
// S = int8_t: codes, times the float16 super-scales of block b's 256 inputs at scale_super / min_super +
// p * panel_super + (b / 8) * 16.
template <typename S>
struct Nibbles {
  const uint8_t* packed;  // [P, K / 8, 64]
  const uint8_t* high;  // [P, K / 8, HB, 2, 8] or null
  const S* scales;
  int64_t panel_s, s_stride;
  const S* mins;
  int64_t panel_m, m_stride;
  const c10::Half* scale_super = nullptr;  // [P, K / 256, 16] when S = int8_t
  const c10::Half* min_super = nullptr;
  int64_t panel_super = 0;
  // codes already unpacked (the low and the high nibbles' vectors of each octet, 128 bytes) for the
  // panels from pre_p0 on: a prompt's row groups reuse one unpacking of a panel (``run_nib``)
  const uint8_t* pre = nullptr;
  int64_t pre_p0 = 0;
};

// The 16 values (scales or mins) of a panel at v + at: float32 / float16 as stored, or int8 codes times
// the float16 super-scale at super + sup (float(d) * float(sc): exact, so the bits of d * sc in float32).
template <typename S>
A8_TARGET inline __m512 panel_values(const S* v, int64_t at, const c10::Half* super, int64_t sup) {
  if constexpr (std::is_same_v<S, int8_t>) {
    const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v + at));
    return _mm512_mul_ps(load16(super + sup), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)));
  } else {
    return load16(v + at);
  }
}

A8_TARGET inline __mmask64 mask64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return _cvtu64_mask64(v);
}

// Octet j of panel p as two vectors of 64 codes: the low and the high nibbles with their HB high bits.
template <int HB, typename S>
A8_TARGET inline void unpack_octet(const Nibbles<S>& w, int64_t K, int64_t p, int64_t j, __m512i& lo, __m512i& hi) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  const __m512i bytes = _mm512_loadu_si512(w.packed + p * K * 8 + j * 64);
  lo = _mm512_and_si512(bytes, low);
  hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
  if constexpr (HB > 0) {
    const uint8_t* planes = w.high + p * (K / 8) * HB * 16 + j * HB * 16;
    for (int h = 0; h < HB; ++h) {
      const __m512i bit = _mm512_set1_epi8(static_cast<char>(16 << h));
      lo = _mm512_or_si512(lo, _mm512_maskz_mov_epi8(mask64(planes + h * 16), bit));
      hi = _mm512_or_si512(hi, _mm512_maskz_mov_epi8(mask64(planes + h * 16 + 8), bit));
    }
  }
}

// Panels p .. p + pn - 1 unpacked into out [pn, K / 8, 128] (``Nibbles::pre``).
template <int HB, typename S>
A8_TARGET void unpack_panels(const Nibbles<S>& w, int64_t K, int64_t p, int64_t pn, uint8_t* out) {
  for (int64_t q = 0; q < pn; ++q) {
    for (int64_t j = 0; j < K / 8; ++j) {
      __m512i lo, hi;
      unpack_octet<HB>(w, K, p + q, j, lo, hi);
      _mm512_storeu_si512(out + (q * (K / 8) + j) * 128, lo);
      _mm512_storeu_si512(out + (q * (K / 8) + j) * 128 + 64, hi);
    }
  }
}

// R rows (quantized, row stride K / KB) through PN panels starting at panel p0 -> y (row stride ldy).
// H: independent integer accumulators per (row, panel, sub-block), to hide vpdpbusd's latency when
// R * PN is small. HB high bit planes, SUB inputs per scale, OFF the codes' offset, MIN: mins per 32.
// PRE: the codes come unpacked (``Nibbles::pre``), a compile-time choice so that the decode tiles keep
// their loop as it was.
template <int R, int PN, int H, typename S, int HB, int SUB, int OFF, bool MIN, bool PRE>
A8_TARGET void nib_tile(const Rows& x, int64_t K, const Nibbles<S>& w, int64_t p0, int64_t r0, float* y, int64_t ldy) {
  constexpr int NS = BLOCK / SUB, OCT = SUB / 8;  // sub-blocks per block, octets per sub-block
  const int64_t KB = K / BLOCK;
  __m512 acc[R][PN];
  zero(acc);
  for (int64_t b = 0; b < KB; ++b) {
    // a sub-block at a time, folded into acc before the next: isum is indexed by constants, so it stays in
    // registers (indexed by octet, Q6_K's lived on the stack); each acc[r][p] gets the same float steps
    for (int u = 0; u < NS; ++u) {
      __m512i isum[R][PN][H];
      zero(isum);
      for (int64_t j = 4 * b + u * OCT; j < 4 * b + (u + 1) * OCT; ++j) {  // the sub-block's octets
        for (int p = 0; p < PN; ++p) {
          __m512i lo, hi;
          if constexpr (PRE) {
            const uint8_t* codes = w.pre + ((p0 + p - w.pre_p0) * (K / 8) + j) * 128;
            lo = _mm512_loadu_si512(codes);
            hi = _mm512_loadu_si512(codes + 64);
          } else {
            unpack_octet<HB>(w, K, p0 + p, j, lo, hi);
          }
          for (int r = 0; r < R; ++r) {
            const uint8_t* xr = x.q.data() + (r0 + r) * K + 8 * j;
            isum[r][p][0] = _mm512_dpbusd_epi32(isum[r][p][0], lo, _mm512_set1_epi32(quad(xr)));
            isum[r][p][H - 1] = _mm512_dpbusd_epi32(isum[r][p][H - 1], hi, _mm512_set1_epi32(quad(xr + 4)));
          }
        }
      }
      for (int p = 0; p < PN; ++p) {
        const __m512 dw = panel_values(w.scales, (p0 + p) * w.panel_s + (b * NS + u) * w.s_stride, w.scale_super,
                                       (p0 + p) * w.panel_super + (b / 8) * OUTS);
        for (int r = 0; r < R; ++r) {
          __m512i total = isum[r][p][0];
          if (H > 1) {
            total = _mm512_add_epi32(total, isum[r][p][H - 1]);
          }
          if constexpr (OFF != 0) {  // the codes' offset times the sub-block's activation sum: exact integers
            const int32_t* qs = x.qs16.data() + (r0 + r) * (K / 16) + (b * NS + u) * (SUB / 16);
            const int32_t sum = SUB == 16 ? qs[0] : qs[0] + qs[1];
            total = _mm512_sub_epi32(total, _mm512_set1_epi32(OFF * sum));
          }
          const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(x.d[(r0 + r) * KB + b]));
          acc[r][p] = _mm512_add_ps(acc[r][p], _mm512_mul_ps(scale, _mm512_cvtepi32_ps(total)));
        }
      }
    }
    if constexpr (MIN) {
      for (int p = 0; p < PN; ++p) {
        const __m512 mw = panel_values(w.mins, (p0 + p) * w.panel_m + b * w.m_stride, w.min_super,
                                       (p0 + p) * w.panel_super + (b / 8) * OUTS);
        for (int r = 0; r < R; ++r) {
          acc[r][p] = _mm512_add_ps(acc[r][p], _mm512_mul_ps(mw, _mm512_set1_ps(x.s[(r0 + r) * KB + b])));
        }
      }
    }
  }
  store(acc, p0, r0, y, ldy);
}

template <int R, int PN, int H, typename S>
A8_TARGET void w8_tile(const Rows& x, int64_t K, const int8_t* packed, const S* scales, const int32_t* corr,
                       int64_t p0, int64_t r0, float* y, int64_t ldy) {
  const int64_t KB = K / BLOCK, panel_bytes = K * 16, panel_s = KB * OUTS;
  __m512 acc[R][PN];
  zero(acc);
  for (int64_t b = 0; b < KB; ++b) {
    __m512i isum[R][PN][H];
    zero(isum);
    for (int64_t j = 8 * b; j < 8 * b + 8; ++j) {  // the block's 8 quads
      for (int p = 0; p < PN; ++p) {
        const __m512i w = _mm512_loadu_si512(packed + (p0 + p) * panel_bytes + j * 64);
        for (int r = 0; r < R; ++r) {
          const __m512i xq = _mm512_set1_epi32(quad(x.q.data() + (r0 + r) * K + 4 * j));
          isum[r][p][j % H] = _mm512_dpbusd_epi32(isum[r][p][j % H], xq, w);
        }
      }
    }
    for (int p = 0; p < PN; ++p) {
      const int64_t at = (p0 + p) * panel_s + b * OUTS;
      const __m512 dw = load16(scales + at);
      const __m512i c = _mm512_loadu_si512(corr + at);
      for (int r = 0; r < R; ++r) {
        __m512i total = isum[r][p][0];
        for (int h = 1; h < H; ++h) {
          total = _mm512_add_epi32(total, isum[r][p][h]);
        }
        total = _mm512_sub_epi32(total, c);
        const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(x.d[(r0 + r) * KB + b]));
        acc[r][p] = _mm512_add_ps(acc[r][p], _mm512_mul_ps(scale, _mm512_cvtepi32_ps(total)));
      }
    }
  }
  store(acc, p0, r0, y, ldy);
}

// Tiles: PN panels per task; rows in groups of up to ROW_GROUP, each group one tile call.
constexpr int64_t TASK_PANELS = 4;

template <int PN, typename S, int HB, int SUB, int OFF, bool MIN, bool PRE>
void nib_rows(const Rows& x, int64_t K, const Nibbles<S>& w, int64_t p0, int64_t r0, int64_t n, float* y, int64_t ldy) {
  switch (n) {
    case 1: return nib_tile<1, PN, 2, S, HB, SUB, OFF, MIN, PRE>(x, K, w, p0, r0, y, ldy);
    case 2: return nib_tile<2, PN, 2, S, HB, SUB, OFF, MIN, PRE>(x, K, w, p0, r0, y, ldy);
    case 3: return nib_tile<3, PN, 1, S, HB, SUB, OFF, MIN, PRE>(x, K, w, p0, r0, y, ldy);
    case 4: return nib_tile<4, PN, 1, S, HB, SUB, OFF, MIN, PRE>(x, K, w, p0, r0, y, ldy);
    default: return nib_tile<5, PN, 1, S, HB, SUB, OFF, MIN, PRE>(x, K, w, p0, r0, y, ldy);
  }
}

template <int PN, typename S>
void w8_rows(const Rows& x, int64_t K, const int8_t* packed, const S* scales, const int32_t* corr,
             int64_t p0, int64_t r0, int64_t n, float* y, int64_t ldy) {
  switch (n) {
    case 1: return w8_tile<1, PN, 4>(x, K, packed, scales, corr, p0, r0, y, ldy);
    case 2: return w8_tile<2, PN, 2>(x, K, packed, scales, corr, p0, r0, y, ldy);
    case 3: return w8_tile<3, PN, 1>(x, K, packed, scales, corr, p0, r0, y, ldy);
    case 4: return w8_tile<4, PN, 1>(x, K, packed, scales, corr, p0, r0, y, ldy);
    default: return w8_tile<5, PN, 1>(x, K, packed, scales, corr, p0, r0, y, ldy);
  }
}

// A task is TASK_PANELS panels (64 outputs) over every row; the panels of a task go through the tile
// two at a time (the last one alone when the count is odd), the rows in as few groups of at most
// ROW_GROUP as there can be, of balanced sizes (8 rows: 4 + 4; 16: 4 x 4).
template <typename Fn>
void over_tasks(int64_t panels, int64_t rows, Fn&& tile) {
  const int64_t tasks = (panels + TASK_PANELS - 1) / TASK_PANELS;
  const int64_t groups = (rows + ROW_GROUP - 1) / ROW_GROUP;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t last = std::min(panels, (t + 1) * TASK_PANELS);
      for (int64_t p = t * TASK_PANELS; p < last; p += 2) {
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t r0 = rows * g / groups, r1 = rows * (g + 1) / groups;
          tile(p, std::min<int64_t>(2, last - p), r0, r1 - r0);
        }
      }
    }
  });
}

// With high bit planes and more rows than one group (a prompt), each panel pair is unpacked once into
// a per-thread scratch buffer (2 x K x 16 bytes) and every row group reads it: the same codes, so the
// same sums, without redoing the bit-plane work per group (a Q5_K matrix of 8192 x 2048 over 512 rows:
// 37-38 -> 33 ms on a 2-core Zen 4; Q6_K's 51 ms was its sub-block sums on the stack, 39 ms since
// ``nib_tile`` folds one sub-block at a time). The scratch is thread_local because ATen's
// parallel_for gives no per-task storage.
template <typename S, int HB, int SUB, int OFF, bool MIN>
void run_nib(const float* x, int64_t R, int64_t K, const Nibbles<S>& w, int64_t N, float* y) {
  const Rows rows = quantize_rows(x, R, K, 0);
  const bool pre = HB > 0 && R > ROW_GROUP;
  over_tasks(N / OUTS, R, [&](int64_t p, int64_t pn, int64_t r0, int64_t n) {
    if constexpr (HB > 0) {
      if (pre) {
        thread_local std::vector<uint8_t> scratch;
        if (r0 == 0) {  // the pair's first row group (over_tasks runs a pair's groups in order, on one thread)
          scratch.resize(static_cast<size_t>(pn * K * 16));
          unpack_panels<HB>(w, K, p, pn, scratch.data());
        }
        Nibbles<S> wp = w;
        wp.pre = scratch.data();
        wp.pre_p0 = p;
        return pn == 2 ? nib_rows<2, S, HB, SUB, OFF, MIN, true>(rows, K, wp, p, r0, n, y, N)
                       : nib_rows<1, S, HB, SUB, OFF, MIN, true>(rows, K, wp, p, r0, n, y, N);
      }
    }
    if (pn == 2) {
      nib_rows<2, S, HB, SUB, OFF, MIN, false>(rows, K, w, p, r0, n, y, N);
    } else {
      nib_rows<1, S, HB, SUB, OFF, MIN, false>(rows, K, w, p, r0, n, y, N);
    }
  });
}

template <typename S>
void run_w8(const float* x, int64_t R, int64_t K, const int8_t* packed, const S* scales, const int32_t* corr,
            int64_t N, float* y) {
  const Rows rows = quantize_rows(x, R, K, 128);
  over_tasks(N / OUTS, R, [&](int64_t p, int64_t pn, int64_t r0, int64_t n) {
    if (pn == 2) {
      w8_rows<2>(rows, K, packed, scales, corr, p, r0, n, y, N);
    } else {
      w8_rows<1>(rows, K, packed, scales, corr, p, r0, n, y, N);
    }
  });
}
#else
inline bool vnni_here() { return false; }
template <typename S>
struct Nibbles {
  const uint8_t* packed;
  const uint8_t* high;
  const S* scales;
  int64_t panel_s, s_stride;
  const S* mins;
  int64_t panel_m, m_stride;
  const c10::Half* scale_super = nullptr;
  const c10::Half* min_super = nullptr;
  int64_t panel_super = 0;
  const uint8_t* pre = nullptr;
  int64_t pre_p0 = 0;
};
template <typename S, int HB, int SUB, int OFF, bool MIN>
void run_nib(const float*, int64_t, int64_t, const Nibbles<S>&, int64_t, float*) {
  TORCH_CHECK(false, "a8 kernels: built without AVX512");
}
template <typename S>
void run_w8(const float*, int64_t, int64_t, const int8_t*, const S*, const int32_t*, int64_t, float*) {
  TORCH_CHECK(false, "w8a8_linear: built without AVX512");
}
#endif

inline void check_x(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % BLOCK == 0, name,
              ": x must be [T, K] float32 with K a multiple of 32");
  TORCH_CHECK(vnni_here(), name, ": this CPU has no AVX512-VNNI");
}

inline void check_packed(const at::Tensor& packed, int64_t K, const char* name) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.size(1) * 8 == K && packed.size(2) == 64
                  && packed.is_contiguous(), name, ": packed must be a contiguous [N / 16, K / 8, 64] uint8");
}
}  // namespace tidespec_a8
