// tidespec::w4a8_linear and tidespec::w8a8_linear: GGUF-style block-quantized weights (Q4_1 and Q8_0
// blocks of 32 inputs) times activations quantized to int8 per block of 32, with integer dot products
// (AVX512-VNNI ``vpdpbusd``): llama.cpp's arithmetic on its CPU path, row-invariant by construction.
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
// with acc from 0 over b in order, each step a float32 multiply or add (built with -ffp-contract=off,
// so none is fused), and y = acc in float32. tests/models/test_a8_linear.py holds the kernels to a
// PyTorch rendering of these lines bit for bit.
//
// Layouts (16 outputs per panel; P = N / 16, KB = K / 32):
//   w4: packed [P, K / 8, 64] uint8: at octet j (features 8j .. 8j + 7), byte 4o + t holds
//       q[16p + o, 8j + t] (low nibble) and q[16p + o, 8j + 4 + t] (high nibble);
//       dm [P, KB, 2, 16] float16: dw then mw of the panel's 16 outputs.
//   w8: packed [P, K / 4, 64] int8: at quad j, byte 4o + t holds q[16p + o, 4j + t];
//       scales [P, KB, 16] float16; corr [P, KB, 16] int32 = 128 * sum of the block's q (vpdpbusd
//       multiplies unsigned by signed bytes: the activations enter as qx + 128, and the correction
//       takes the 128s back out, exactly).
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
#include <vector>

namespace {

constexpr int64_t BLOCK = 32;  // features per weight and activation block
constexpr int64_t OUTS = 16;  // outputs per panel (one zmm of int32 / float32)
constexpr int64_t ROW_GROUP = 5;  // most rows sharing an unpacked weight vector (a gamma-4 verification)

#if defined(CPU_CAPABILITY_AVX512)
#define A8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))

bool vnni_here() { return __builtin_cpu_supports("avx512vnni"); }

// One row's activations: x [K] float32 -> qx [K] int8 (plus `offset`: 0, or 128 for the unsigned
// operand of w8a8), dx [KB], sx [KB].
A8_TARGET void quantize_row(const float* x, int64_t K, uint8_t offset, uint8_t* qx, float* dx, float* sx) {
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
    const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
    const __m128i o = _mm_set1_epi8(static_cast<char>(offset));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + b * BLOCK), _mm_add_epi8(_mm512_cvtepi32_epi8(c0), o));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + b * BLOCK + 16), _mm_add_epi8(_mm512_cvtepi32_epi8(c1), o));
    dx[b] = d;
    sx[b] = d * static_cast<float>(sum);
  }
}

struct Rows {  // the call's activations, quantized once
  std::vector<uint8_t> q;  // [R, K]
  std::vector<float> d, s;  // [R, KB]
};

Rows quantize_rows(const float* x, int64_t R, int64_t K, uint8_t offset) {
  Rows rows{std::vector<uint8_t>(R * K), std::vector<float>(R * (K / BLOCK)), std::vector<float>(R * (K / BLOCK))};
  for (int64_t r = 0; r < R; ++r) {
    quantize_row(x + r * K, K, offset, rows.q.data() + r * K, rows.d.data() + r * (K / BLOCK),
                 rows.s.data() + r * (K / BLOCK));
  }
  return rows;
}

inline int32_t quad(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

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

// R rows (quantized, row stride K / KB) through PN panels starting at panel p0 -> y (row stride ldy).
// H: independent integer accumulators per (row, panel), to hide vpdpbusd's latency when R * PN is small.
template <int R, int PN, int H>
A8_TARGET void w4_tile(const Rows& x, int64_t K, const uint8_t* packed, const c10::Half* dm, int64_t p0, int64_t r0,
                       float* y, int64_t ldy) {
  const int64_t KB = K / BLOCK, panel_bytes = K * 8, panel_dm = KB * 2 * OUTS;
  const __m512i low = _mm512_set1_epi8(0x0f);
  __m512 acc[R][PN];
  zero(acc);
  for (int64_t b = 0; b < KB; ++b) {
    __m512i isum[R][PN][H];
    zero(isum);
    for (int64_t j = 4 * b; j < 4 * b + 4; ++j) {  // the block's 4 octets
      for (int p = 0; p < PN; ++p) {
        const __m512i bytes = _mm512_loadu_si512(packed + (p0 + p) * panel_bytes + j * 64);
        const __m512i lo = _mm512_and_si512(bytes, low);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
        for (int r = 0; r < R; ++r) {
          const uint8_t* xr = x.q.data() + (r0 + r) * K + 8 * j;
          isum[r][p][0] = _mm512_dpbusd_epi32(isum[r][p][0], lo, _mm512_set1_epi32(quad(xr)));
          isum[r][p][H - 1] = _mm512_dpbusd_epi32(isum[r][p][H - 1], hi, _mm512_set1_epi32(quad(xr + 4)));
        }
      }
    }
    for (int p = 0; p < PN; ++p) {
      const c10::Half* s = dm + (p0 + p) * panel_dm + b * 2 * OUTS;
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
      const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + OUTS)));
      for (int r = 0; r < R; ++r) {
        __m512i total = isum[r][p][0];
        if (H > 1) {
          total = _mm512_add_epi32(total, isum[r][p][H - 1]);
        }
        const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(x.d[(r0 + r) * KB + b]));
        acc[r][p] = _mm512_add_ps(acc[r][p], _mm512_mul_ps(scale, _mm512_cvtepi32_ps(total)));
        acc[r][p] = _mm512_add_ps(acc[r][p], _mm512_mul_ps(mw, _mm512_set1_ps(x.s[(r0 + r) * KB + b])));
      }
    }
  }
  store(acc, p0, r0, y, ldy);
}

template <int R, int PN, int H>
A8_TARGET void w8_tile(const Rows& x, int64_t K, const int8_t* packed, const c10::Half* scales, const int32_t* corr,
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
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + at)));
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

template <int PN>
void w4_rows(const Rows& x, int64_t K, const uint8_t* packed, const c10::Half* dm, int64_t p0, int64_t r0,
             int64_t n, float* y, int64_t ldy) {
  switch (n) {
    case 1: return w4_tile<1, PN, 2>(x, K, packed, dm, p0, r0, y, ldy);
    case 2: return w4_tile<2, PN, 2>(x, K, packed, dm, p0, r0, y, ldy);
    case 3: return w4_tile<3, PN, 1>(x, K, packed, dm, p0, r0, y, ldy);
    case 4: return w4_tile<4, PN, 1>(x, K, packed, dm, p0, r0, y, ldy);
    default: return w4_tile<5, PN, 1>(x, K, packed, dm, p0, r0, y, ldy);
  }
}

template <int PN>
void w8_rows(const Rows& x, int64_t K, const int8_t* packed, const c10::Half* scales, const int32_t* corr,
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

void run_w4(const float* x, int64_t R, int64_t K, const uint8_t* packed, const c10::Half* dm, int64_t N, float* y) {
  const Rows rows = quantize_rows(x, R, K, 0);
  over_tasks(N / OUTS, R, [&](int64_t p, int64_t pn, int64_t r0, int64_t n) {
    if (pn == 2) {
      w4_rows<2>(rows, K, packed, dm, p, r0, n, y, N);
    } else {
      w4_rows<1>(rows, K, packed, dm, p, r0, n, y, N);
    }
  });
}

void run_w8(const float* x, int64_t R, int64_t K, const int8_t* packed, const c10::Half* scales, const int32_t* corr,
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
bool vnni_here() { return false; }
void run_w4(const float*, int64_t, int64_t, const uint8_t*, const c10::Half*, int64_t, float*) {
  TORCH_CHECK(false, "w4a8_linear: built without AVX512");
}
void run_w8(const float*, int64_t, int64_t, const int8_t*, const c10::Half*, const int32_t*, int64_t, float*) {
  TORCH_CHECK(false, "w8a8_linear: built without AVX512");
}
#endif

void check_x(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % BLOCK == 0, name,
              ": x must be [T, K] float32 with K a multiple of 32");
  TORCH_CHECK(vnni_here(), name, ": this CPU has no AVX512-VNNI");
}

// x [T, K] float32, packed [N / 16, K / 8, 64] uint8, dm [N / 16, K / 32, 2, 16] float16 -> [T, N] float32.
at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& dm) {
  check_x(x, "w4a8_linear");
  const int64_t K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.size(1) * 8 == K && packed.size(2) == 64
                  && packed.is_contiguous(), "w4a8_linear: packed must be a contiguous [N / 16, K / 8, 64] uint8");
  TORCH_CHECK(dm.dim() == 4 && dm.scalar_type() == at::kHalf && dm.size(0) == P && dm.size(1) * BLOCK == K
                  && dm.size(2) == 2 && dm.size(3) == OUTS && dm.is_contiguous(),
              "w4a8_linear: dm must be a contiguous [N / 16, K / 32, 2, 16] float16");
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), P * OUTS}, x.options());
  if (x.size(0) > 0) {
    run_w4(xc.data_ptr<float>(), x.size(0), K, packed.data_ptr<uint8_t>(), dm.data_ptr<c10::Half>(), P * OUTS,
           y.data_ptr<float>());
  }
  return y;
}

// x [T, K] float32, packed [N / 16, K / 4, 64] int8, scales [N / 16, K / 32, 16] float16, corr of the
// same shape int32 -> [T, N] float32.
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& corr) {
  check_x(x, "w8a8_linear");
  const int64_t K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kChar && packed.size(1) * 4 == K && packed.size(2) == 64
                  && packed.is_contiguous(), "w8a8_linear: packed must be a contiguous [N / 16, K / 4, 64] int8");
  TORCH_CHECK(scales.dim() == 3 && scales.scalar_type() == at::kHalf && scales.size(0) == P
                  && scales.size(1) * BLOCK == K && scales.size(2) == OUTS && scales.is_contiguous(),
              "w8a8_linear: scales must be a contiguous [N / 16, K / 32, 16] float16");
  TORCH_CHECK(corr.sizes() == scales.sizes() && corr.scalar_type() == at::kInt && corr.is_contiguous(),
              "w8a8_linear: corr must be a contiguous int32 of the scales' shape");
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), P * OUTS}, x.options());
  if (x.size(0) > 0) {
    run_w8(xc.data_ptr<float>(), x.size(0), K, packed.data_ptr<int8_t>(), scales.data_ptr<c10::Half>(),
           corr.data_ptr<int32_t>(), P * OUTS, y.data_ptr<float>());
  }
  return y;
}

bool a8_linear_available() { return vnni_here(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tidespec, m) {
  m.def("w4a8_linear(Tensor x, Tensor packed, Tensor dm) -> Tensor");
  m.def("w8a8_linear(Tensor x, Tensor packed, Tensor scales, Tensor corr) -> Tensor");
  m.def("a8_linear_available() -> bool", &a8_linear_available);
}

TORCH_LIBRARY_IMPL(tidespec, CPU, m) {
  m.impl("w4a8_linear", &w4a8_linear);
  m.impl("w8a8_linear", &w8a8_linear);
}
