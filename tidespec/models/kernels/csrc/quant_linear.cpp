// tidespec::int4_linear and tidespec::int8_linear: PyTorch's weight-only CPU kernels on AVX512
// (``aten::_weight_int4pack_mm_for_cpu``, ``aten::_weight_int8pack_mm``), bit for bit, with the
// weights converted once per call for up to 8 (int4) or 6 (int8) rows instead of once per 4 rows.
//
// Why this exists: both of PyTorch's kernels (int4mm_kernel.cpp and int8mm_kernel.cpp, "tinygemm")
// split the rows into blocks of 4 and convert the weights again for every block, and their tasks run
// row block by row block: a speculative verification of gamma 4 has 5 rows per sequence, so with 2
// threads one thread takes the 4-row block over every output and the other the 1-row block, and the
// call costs about 4 rows on one core. Measured on the embedded model (Zen 4, 2 threads): the int8 LM
// head (49,152 x 576) took 0.84 ms for one row and 4.7 ms for 5, and a verification forward cost
// 1.45x a decode forward, which caps what speculation on the quantized paths gains. Here a task is a
// block of outputs over every row, and it converts a vector of weights once for a group of rows:
// the LM head takes 0.80 ms for one row and 1.9 ms for 5.
//
// The arithmetic is ATen's, so outputs are the same bits (tests/models/test_quant_linear.py).
//
// int4: for each output o and input feature k in order,
//
//   w = fma(q[o, k] - 8, scale[g, o], zero[g, o])         (g = k / group_size; float32)
//   acc[r, o] = fma(float(x[r, k]), w, acc[r, o])         (from 0; float32)
//
// and the sum is rounded once to bfloat16 (to nearest even). Layout (ATen's AVX512 packing,
// ``_convert_weight_to_int4pack_for_cpu`` with N a multiple of 64): packed [N / 64, K, 32] uint8; at
// feature k of panel p, byte d < 16 holds output 64p + d (low nibble) and 64p + 32 + d (high nibble),
// byte 16 + d holds 64p + 16 + d and 64p + 48 + d. scale_zero [K / group_size, N, 2] bfloat16.
//
// int8: for each output o, 16 partial sums (lane l takes features l, l + 16, l + 32, ...),
//
//   acc[r, o][l] = fma(float(x[r, k]), float(q[o, k]) * scale[o], acc[r, o][l])   (k = l, l + 16, ...)
//
// (the product q * scale of an int8 and a bfloat16 is exact in float32), then the 16 lanes summed
// by ``_mm512_reduce_add_ps`` (a fixed tree) and rounded once to bfloat16. qweight [N, K] int8,
// scales [N] bfloat16, K a multiple of 16.
//
// Either way a row's result does not depend on the other rows of the call, on the tile or on the
// thread: row-invariant by construction.
//
// Worked example (int4; K = 2, group 2, one output; q = [9, 7], scale 1, zero 0.5): w = [1.5, -0.5];
// x = [[2, 4]] -> fma(4, -0.5, fma(2, 1.5, 0)) = 1.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t PANEL = 64;  // int4: outputs per packed panel
constexpr int64_t MAX_ROWS = 8;  // int4: rows sharing a dequantized vector (4 x 8 accumulators: some spill)
constexpr int64_t INT8_COLS = 4;  // int8: outputs per tile
constexpr int64_t INT8_TILES = 4;  // int8: tiles per task
constexpr int64_t INT8_ROWS = 6;  // int8: rows sharing a converted vector (4 x 6 accumulators + 4 + 1 registers)

#if defined(CPU_CAPABILITY_AVX512)
constexpr bool AVAILABLE = true;

// The 16 (scale, zero) pairs of outputs o .. o + 15 at group g, widened to float32 and split.
inline void load_scale_zero(const c10::BFloat16* sz, __m512& scale, __m512& zero) {
  const __m512i pairs = _mm512_loadu_si512(sz);  // s0 z0 s1 z1 ... s15 z15
  const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(pairs)), 16));
  const __m512 hi =
      _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(pairs, 1)), 16));
  const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odds = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  scale = _mm512_permutex2var_ps(lo, evens, hi);
  zero = _mm512_permutex2var_ps(lo, odds, hi);
}

// R rows of x (row stride K) through one panel: its bytes at b (feature k at b + 32 k), its
// scale/zero pairs at sz (group g at sz + g * ldsz, output o at + 2 o) and its outputs to y (row
// stride ldy), both from the panel's first output. Vector v holds the low (v < 2) or high nibbles
// of bytes 16 (v % 2) onward: outputs 16 (v % 2) + 32 (v / 2) + [0, 16) of the panel.
template <int R>
void int4_tile(const c10::BFloat16* x, int64_t K, int64_t group, const uint8_t* b, const c10::BFloat16* sz,
               int64_t ldsz, c10::BFloat16* y, int64_t ldy) {
  constexpr int V = 4;
  constexpr int64_t out[V] = {0, 16, 32, 48};
  // nibble n -> n - 8 (permutexvar reads an index's low 4 bits)
  const __m512 lut = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) {
      acc[r][v] = _mm512_setzero_ps();
    }
  }
  for (int64_t k0 = 0; k0 < K; k0 += group) {
    __m512 scale[V], zero[V];
    for (int v = 0; v < V; ++v) {
      load_scale_zero(sz + k0 / group * ldsz + 2 * out[v], scale[v], zero[v]);
    }
    for (int64_t k = k0; k < k0 + group; ++k) {
      __m512 w[V];
      for (int j = 0; j < 2; ++j) {
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + k * 32 + 16 * j)));
        w[j] = _mm512_fmadd_ps(_mm512_permutexvar_ps(q, lut), scale[j], zero[j]);
        w[2 + j] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut), scale[2 + j], zero[2 + j]);
      }
      for (int r = 0; r < R; ++r) {
        const __m512 xb = _mm512_set1_ps(static_cast<float>(x[r * K + k]));
        for (int v = 0; v < V; ++v) {
          acc[r][v] = _mm512_fmadd_ps(xb, w[v], acc[r][v]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) {
      float sums[16];
      _mm512_storeu_ps(sums, acc[r][v]);
      for (int i = 0; i < 16; ++i) {
        y[r * ldy + out[v] + i] = static_cast<c10::BFloat16>(sums[i]);
      }
    }
  }
}

using Int4TileFn = void (*)(const c10::BFloat16*, int64_t, int64_t, const uint8_t*, const c10::BFloat16*, int64_t,
                            c10::BFloat16*, int64_t);

Int4TileFn int4_pick(int64_t R) {
  switch (R) {
    case 1: return &int4_tile<1>;
    case 2: return &int4_tile<2>;
    case 3: return &int4_tile<3>;
    case 4: return &int4_tile<4>;
    case 5: return &int4_tile<5>;
    case 6: return &int4_tile<6>;
    case 7: return &int4_tile<7>;
    default: return &int4_tile<8>;
  }
}

// x [rows, K], packed [N / 64, K, 32], scale_zero [K / group, N, 2] -> y [rows, N] bfloat16. A task
// is a panel (64 outputs) over every row, in groups of up to 8 rows.
void run_int4(const at::Tensor& x, const at::Tensor& packed, int64_t group, const at::Tensor& scale_zero,
              at::Tensor& y) {
  const int64_t rows = x.size(0), K = x.size(1), N = y.size(1);
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const uint8_t* bp = packed.data_ptr<uint8_t>();
  const c10::BFloat16* szp = scale_zero.data_ptr<c10::BFloat16>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  at::parallel_for(0, N / PANEL, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) {
        int4_pick(std::min<int64_t>(MAX_ROWS, rows - r0))(xp + r0 * K, K, group, bp + p * K * 32,
                                                         szp + 2 * p * PANEL, 2 * N, yp + r0 * N + p * PANEL, N);
      }
    }
  });
}

// R rows of x (float32, row stride K) times C outputs of qweight (rows of q, stride K) with their
// scales -> y (row stride ldy).
template <int R, int C>
void int8_tile(const float* x, int64_t K, const int8_t* q, const c10::BFloat16* scales, c10::BFloat16* y,
               int64_t ldy) {
  __m512 scale[C];
  for (int c = 0; c < C; ++c) {
    scale[c] = _mm512_set1_ps(static_cast<float>(scales[c]));
  }
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      acc[r][c] = _mm512_setzero_ps();
    }
  }
  for (int64_t k = 0; k < K; k += 16) {
    __m512 w[C];
    for (int c = 0; c < C; ++c) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c * K + k));
      w[c] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), scale[c]);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * K + k);
      for (int c = 0; c < C; ++c) {
        acc[r][c] = _mm512_fmadd_ps(xv, w[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      y[r * ldy + c] = static_cast<c10::BFloat16>(_mm512_reduce_add_ps(acc[r][c]));
    }
  }
}

using Int8TileFn = void (*)(const float*, int64_t, const int8_t*, const c10::BFloat16*, c10::BFloat16*, int64_t);

template <int C>
Int8TileFn int8_rows(int64_t R) {
  switch (R) {
    case 1: return &int8_tile<1, C>;
    case 2: return &int8_tile<2, C>;
    case 3: return &int8_tile<3, C>;
    case 4: return &int8_tile<4, C>;
    case 5: return &int8_tile<5, C>;
    default: return &int8_tile<6, C>;
  }
}

Int8TileFn int8_pick(int64_t R, int64_t C) {
  switch (C) {
    case 1: return int8_rows<1>(R);
    case 2: return int8_rows<2>(R);
    case 3: return int8_rows<3>(R);
    default: return int8_rows<4>(R);
  }
}

// x float32 [rows, K], qweight [N, K], scales [N] -> y [rows, N] bfloat16. A task is up to 16 outputs
// (4 tiles of 4) over every row, in groups of up to 6 rows.
void run_int8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, at::Tensor& y) {
  const int64_t rows = x.size(0), K = x.size(1), N = y.size(1);
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = qweight.data_ptr<int8_t>();
  const c10::BFloat16* sp = scales.data_ptr<c10::BFloat16>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const int64_t per_task = INT8_COLS * INT8_TILES, tasks = (N + per_task - 1) / per_task;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t o = t * per_task; o < std::min(N, (t + 1) * per_task); o += INT8_COLS) {
        const int64_t c = std::min<int64_t>(INT8_COLS, N - o);
        for (int64_t r0 = 0; r0 < rows; r0 += INT8_ROWS) {
          int8_pick(std::min<int64_t>(INT8_ROWS, rows - r0), c)(xp + r0 * K, K, qp + o * K, sp + o, yp + r0 * N + o, N);
        }
      }
    }
  });
}
#else
constexpr bool AVAILABLE = false;
void run_int4(const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&, at::Tensor&) {
  TORCH_CHECK(false, "int4_linear: built without AVX512 (use aten::_weight_int4pack_mm_for_cpu)");
}
void run_int8(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&) {
  TORCH_CHECK(false, "int8_linear: built without AVX512 (use aten::_weight_int8pack_mm)");
}
#endif

// x [T, K] bfloat16, packed [N, K / 2] uint8 (ATen's AVX512 int4 packing), scale_zero [K / group, N, 2]
// bfloat16 -> [T, N] bfloat16, equal to aten::_weight_int4pack_mm_for_cpu(x, packed, group, scale_zero).
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, int64_t group, const at::Tensor& scale_zero) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "int4_linear: x must be [T, K] bfloat16");
  const int64_t K = x.size(1), N = packed.size(0);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.size(1) * 2 == K && N % PANEL == 0
                  && packed.is_contiguous(), "int4_linear: packed must be a contiguous [N, K / 2] uint8 with N a "
              "multiple of 64");
  TORCH_CHECK(group > 0 && K % group == 0, "int4_linear: K must be a multiple of the group size");
  TORCH_CHECK(scale_zero.dim() == 3 && scale_zero.scalar_type() == at::kBFloat16 && scale_zero.size(0) == K / group
                  && scale_zero.size(1) == N && scale_zero.size(2) == 2 && scale_zero.is_contiguous(),
              "int4_linear: scale_zero must be a contiguous [K / group, N, 2] bfloat16");
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  if (x.size(0) > 0) {
    run_int4(x.contiguous(), packed, group, scale_zero, y);
  }
  return y;
}

// x [T, K] bfloat16, qweight [N, K] int8, scales [N] bfloat16 -> [T, N] bfloat16, equal to
// aten::_weight_int8pack_mm(x, qweight, scales).
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "int8_linear: x must be [T, K] bfloat16");
  const int64_t K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.size(1) == K && K % 16 == 0
                  && qweight.is_contiguous(), "int8_linear: qweight must be a contiguous [N, K] int8 with K a multiple "
              "of 16");
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kBFloat16 && scales.size(0) == N
                  && scales.is_contiguous(), "int8_linear: scales must be a contiguous [N] bfloat16");
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  if (x.size(0) > 0) {
    run_int8(x.to(at::kFloat).contiguous(), qweight, scales, y);
  }
  return y;
}

bool quant_linear_available() { return AVAILABLE; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tidespec, m) {
  m.def("int4_linear(Tensor x, Tensor packed, int group_size, Tensor scale_zero) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales) -> Tensor");
  m.def("quant_linear_available() -> bool", &quant_linear_available);  // no tensor to dispatch on: one kernel
}

TORCH_LIBRARY_IMPL(tidespec, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_linear", &int8_linear);
}
