// tidespec::exact_linear: a GEMM whose every output is one float32 fma chain over the input features
// in their order, so a row's bits do not depend on how many rows share the call, on the tile it
// falls in or on the thread that computes it: row-invariant by construction, on every CPU. float32,
// bfloat16 and float16 operands; a bfloat16/float16 call widens each operand to float32 exactly,
// runs the same chain and rounds the sum once to the output dtype (to nearest even), as the
// library GEMMs do with their float32 accumulators. On CPUs with AVX512-BF16 bfloat16 runs its
// own chain of pair products instead (``Bf16Pairs`` below), fixed for the process.
//
// Why this exists: the library sgemms choose their kernel by the row count, and where they do it
// differs by CPU. On a Sapphire Rapids VM MKL's packed sgemm stays row-invariant from 1 to 1,024
// rows; on an AMD EPYC (Zen 4) it changes kernel after 3 rows and F.linear after 1, so the only
// invariant library choice left there was F.linear on 16-row tiles, which makes a 1-row decode pay
// for 16 rows (3x slower than plain decoding, measured). This kernel costs a decode row one row.
// bfloat16 had oneDNN's GEMM on tiles padded to 2..64 rows ("tall64"): a decode row paid for two.
//
// Layout: the weight [out, in] is packed once into panels of VL outputs, wp [P, in, VL] (P =
// ceil(out / VL), the last panel zero-padded; ``models/linear.py`` packs it), so the VL outputs of
// a panel at input feature k are one vector load. A task computes R rows x V panels; its R * V
// accumulators stay in registers while the V panels stream through once for the R rows:
//
//   y[r, o] = fma(x[r, K-1], W[o, K-1], ... fma(x[r, 1], W[o, 1], fma(x[r, 0], W[o, 0], 0)) ...)
//
// for every (r, o), whatever R, V and the lane o falls in: the tiling changes only which
// independent chains run together. The file is compiled with -ffp-contract=off and OpenMP (kernels.py):
// tasks of V panels are spread over PyTorch's threads, and a thread never changes a chain either.
//
// Worked example (K = 2, one output): x = [[1, 2]], W = [[3, 4]] -> y = fma(2, 4, fma(1, 3, 0)) = 11.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <optional>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t VL = Vec::size();  // outputs per panel
constexpr int64_t REGS = VL == 16 ? 32 : 16;  // vector registers: AVX512 has 32, AVX2 16

// VL weights of one panel at one input feature, widened to float32 (exactly: every bfloat16 and
// float16 value is a float32 value).
inline Vec load_panel(const float* p) { return Vec::loadu(p); }
inline Vec load_panel(const c10::BFloat16* p) {
  Vec out;
  at::vec::load_fp32_from_bf16(p, out);
  return out;
}
inline Vec load_panel(const c10::Half* p) {
  Vec out;
  at::vec::load_fp32_from_fp16(p, out);
  return out;
}

// n <= VL sums to y: as they are in float32, else each rounded once to T (to nearest even).
inline void store_sums(const Vec& acc, float* y, int64_t n) { acc.store(y, static_cast<int>(n)); }
template <typename T>
void store_sums(const Vec& acc, T* y, int64_t n) {
  float sums[VL];
  acc.store(sums);
  for (int64_t i = 0; i < n; ++i) {
    y[i] = static_cast<T>(sums[i]);
  }
}

// Stores R x V accumulator vectors of a tile: panel v's VL sums go to outputs o0 + v * VL .. (clipped
// to n_out) of each of the R rows of y (row stride ldy).
template <typename Y, int R, int V>
inline void store_tile(const Vec (&acc)[R][V], Y* y, int64_t ldy, int64_t o0, int64_t n_out) {
  for (int v = 0; v < V; ++v) {
    const int64_t o = o0 + v * VL;
    const int64_t n = std::min<int64_t>(VL, n_out - o);
    if (n <= 0) {
      break;
    }
    for (int r = 0; r < R; ++r) {
      store_sums(acc[r][v], y + r * ldy + o, n);
    }
  }
}

// A chain is a struct with the operand types X (one step of a row of x), W (the panels' values) and Y
// (the output), STEP (W values per panel at one step) and ``tile<R, V>``: R rows of x (row stride
// ldx) times V panels from wp (panel v at wp + v * steps * STEP) into y (row stride ldy), outputs
// o0 .. o0 + V * VL clipped to n_out. ``pick`` and ``run`` below are shared by every chain.

// The widening chain: x in float32, each weight widened exactly to float32, one fma per feature.
template <typename T>
struct Widening {
  using X = float;
  using W = T;
  using Y = T;
  static constexpr int64_t STEP = VL;

  template <int R, int V>
  static void tile(const X* x, int64_t ldx, const W* wp, int64_t K, Y* y, int64_t ldy, int64_t o0, int64_t n_out) {
    Vec acc[R][V];
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < V; ++v) {
        acc[r][v] = Vec(0.f);
      }
    }
    for (int64_t k = 0; k < K; ++k) {
      Vec w[V];
      for (int v = 0; v < V; ++v) {
        w[v] = load_panel(wp + (v * K + k) * STEP);
      }
      for (int r = 0; r < R; ++r) {
        const Vec xb(x[r * ldx + k]);
        for (int v = 0; v < V; ++v) {
          acc[r][v] = at::vec::fmadd(xb, w[v], acc[r][v]);
        }
      }
    }
    store_tile(acc, y, ldy, o0, n_out);
  }
};

#if defined(CPU_CAPABILITY_AVX512)
// bfloat16 on CPUs with AVX512-BF16 (Zen 4, Cooper Lake, Sapphire Rapids and later): vdpbf16ps
// multiplies 16 pairs of bfloat16 and adds both products to float32 accumulators, each product exact
// and each addition rounded to nearest even (the odd feature's product first, then the even one's;
// Intel SDM, VDPBF16PS), so an output is again one fixed chain over the input features, now in the
// order 1, 0, 3, 2, ..., at twice the multiply-adds per instruction of the widening fma. Panels
// hold feature pairs: wp [P, K2, VL, 2] (K2 = ceil(K / 2), an odd K zero-padded), and x is read as
// [rows, K2] pairs (a uint32 each). Subnormal inputs count as zero (the instruction's DAZ), the
// same in every call.
struct Bf16Pairs {
  using X = uint32_t;
  using W = c10::BFloat16;
  using Y = c10::BFloat16;
  static constexpr int64_t STEP = 2 * VL;

  template <int R, int V>
  __attribute__((target("avx512f,avx512bf16"))) static void tile(const X* x, int64_t ldx, const W* wp, int64_t K2,
                                                                 Y* y, int64_t ldy, int64_t o0, int64_t n_out) {
    Vec acc[R][V];
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < V; ++v) {
        acc[r][v] = Vec(0.f);
      }
    }
    for (int64_t k = 0; k < K2; ++k) {
      __m512i w[V];
      for (int v = 0; v < V; ++v) {
        w[v] = _mm512_loadu_si512(wp + (v * K2 + k) * STEP);
      }
      for (int r = 0; r < R; ++r) {
        const __m512i xb = _mm512_set1_epi32(static_cast<int>(x[r * ldx + k]));
        for (int v = 0; v < V; ++v) {
          acc[r][v] = Vec(_mm512_dpbf16_ps(acc[r][v], (__m512bh)xb, (__m512bh)w[v]));
        }
      }
    }
    store_tile(acc, y, ldy, o0, n_out);
  }
};

bool has_bf16_pairs() { return __builtin_cpu_supports("avx512bf16"); }
#else
bool has_bf16_pairs() { return false; }
#endif

template <typename C>
using TileFn = void (*)(const typename C::X*, int64_t, const typename C::W*, int64_t, typename C::Y*, int64_t, int64_t,
                        int64_t);

template <typename C, int R>
TileFn<C> with_panels(int64_t V) {
  switch (V) {
    case 1: return &C::template tile<R, 1>;
    case 2: return &C::template tile<R, 2>;
    case 3: return &C::template tile<R, 3>;
    case 4: return &C::template tile<R, 4>;
    case 5: return &C::template tile<R, 5>;
    case 6: return &C::template tile<R, 6>;
    case 7: return &C::template tile<R, 7>;
    default: return &C::template tile<R, 8>;
  }
}

template <typename C>
TileFn<C> pick(int64_t R, int64_t V) {
  switch (R) {
    case 1: return with_panels<C, 1>(V);
    case 2: return with_panels<C, 2>(V);
    case 3: return with_panels<C, 3>(V);
    default: return with_panels<C, 4>(V);
  }
}

// Panels per task, at most ``most``: the fewest panels the busiest thread gets when ``tasks`` tasks
// are split evenly among ``threads``, the larger count on a tie. Example: 36 panels, at most 8, 2
// threads -> 6 (3 tasks each, 18 panels; 8 would make 5 tasks, 24 panels for one thread).
int64_t balanced_panels(int64_t P, int64_t most, int64_t threads) {
  int64_t best = most, best_load = INT64_MAX;
  for (int64_t v = most; v >= (most + 1) / 2; --v) {
    const int64_t tasks = (P + v - 1) / v;
    const int64_t load = (tasks + threads - 1) / threads * v;
    if (load < best_load) {
      best = v;
      best_load = load;
    }
  }
  return best;
}

// x [rows, steps] (contiguous, in C::X), wp [P, steps, C::STEP], y [rows, n_out]. Rows and panels
// per task: a row alone needs 8 independent chains to hide the fma latency; more rows share each
// panel load, with R * V accumulators + V panel vectors + 1 broadcast in registers. The tiling
// changes no output's chain, only which chains run together.
template <typename C>
void run(const typename C::X* x, int64_t rows, const at::Tensor& wp, typename C::Y* y, int64_t n_out) {
  const int64_t steps = wp.size(1), P = wp.size(0);
  const int64_t R = std::min<int64_t>(rows, 4);
  const int64_t V = balanced_panels(P, std::min<int64_t>(8, (REGS - 1) / (R + 1)), at::get_num_threads());
  const auto* wpp = static_cast<const typename C::W*>(wp.data_ptr());
  const int64_t tasks = (P + V - 1) / V;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p0 = t * V, v = std::min<int64_t>(V, P - p0);
      for (int64_t r0 = 0; r0 < rows; r0 += R) {
        const int64_t r = std::min<int64_t>(R, rows - r0);
        pick<C>(r, v)(x + r0 * steps, steps, wpp + p0 * steps * C::STEP, steps, y + r0 * n_out, n_out, p0 * VL, n_out);
      }
    }
  });
}

template <typename T>
void run_widening(const at::Tensor& x, const at::Tensor& wp, at::Tensor& y) {
  run<Widening<T>>(x.data_ptr<float>(), x.size(0), wp, y.data_ptr<T>(), y.size(1));
}

// Whether bfloat16 panels hold feature pairs (``run_pairs``): fixed for the process, so every call
// of a layer, whatever its rows, runs the same chain.
bool bf16_pairs() {
  static const bool pairs = has_bf16_pairs();
  return pairs;
}

// x [T, K], wp [P, K, VL] (the packed weight), both float32, bfloat16 or float16; n_out <= P * VL
// -> [T, n_out] in x's dtype.
at::Tensor exact_linear(const at::Tensor& x, const at::Tensor& wp, int64_t n_out) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf),
              "exact_linear: x must be [T, in] float32, bfloat16 or float16");
  const bool pairs = dtype == at::kBFloat16 && bf16_pairs();
  const int64_t K = x.size(1), lanes = pairs ? 2 * VL : VL, steps = pairs ? (K + 1) / 2 : K;
  TORCH_CHECK(wp.dim() == 3 && wp.scalar_type() == dtype && wp.size(2) == lanes && wp.size(1) == steps
                  && wp.is_contiguous(), "exact_linear: wp must be a contiguous [P, ", steps, ", ", lanes,
              "] packing in x's dtype");
  TORCH_CHECK(n_out > (wp.size(0) - 1) * VL && n_out <= wp.size(0) * VL, "exact_linear: n_out does not match wp");
  at::Tensor y = at::empty({x.size(0), n_out}, x.options());
  if (x.size(0) == 0) {
    return y;
  }
  if (pairs) {
#if defined(CPU_CAPABILITY_AVX512)
    const at::Tensor xc = K % 2 ? at::constant_pad_nd(x, {0, 1}).contiguous() : x.contiguous();
    run<Bf16Pairs>(reinterpret_cast<const uint32_t*>(xc.data_ptr<c10::BFloat16>()), x.size(0), wp,
                   y.data_ptr<c10::BFloat16>(), n_out);
#endif
    return y;
  }
  const at::Tensor xc = x.to(at::kFloat).contiguous();  // a float32 x as it is (no copy when contiguous)
  if (dtype == at::kFloat) {
    run_widening<float>(xc, wp, y);
  } else if (dtype == at::kBFloat16) {
    run_widening<c10::BFloat16>(xc, wp, y);
  } else {
    run_widening<c10::Half>(xc, wp, y);
  }
  return y;
}

int64_t exact_linear_lanes() { return VL; }

bool exact_linear_bf16_pairs() { return bf16_pairs(); }

// packed_linear(x, packed, w): MKL's packed sgemm (PyTorch's mkl::_mkl_linear) over a weight packed
// once, called with the input's own row count: measured row-invariant on the Xeons (a row's bits do not
// depend on how many rows share the call, 1 to 1024 rows), where a plain sgemm picks its kernel by the
// row count. An op of its own so that torch.compile calls it as it is (inductor's own lowering of
// mkl::_mkl_linear wants a constant row count).
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkl::_mkl_linear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const std::optional<at::Tensor>&, int64_t)>();
  return op.call(x, packed, w, std::nullopt, x.size(0));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tidespec, m) {
  m.def("exact_linear(Tensor x, Tensor wp, int n_out) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, Tensor w) -> Tensor");
  m.def("exact_linear_lanes() -> int", &exact_linear_lanes);  // no tensor to dispatch on: one kernel
  m.def("exact_linear_bf16_pairs() -> bool", &exact_linear_bf16_pairs);
}

TORCH_LIBRARY_IMPL(tidespec, CPU, m) {
  m.impl("exact_linear", &exact_linear);
  m.impl("packed_linear", &packed_linear);
}

TORCH_LIBRARY_IMPL(tidespec, MkldnnCPU, m) {  // the packed weight is an MKL-DNN tensor: its key wins
  m.impl("packed_linear", &packed_linear);
}
