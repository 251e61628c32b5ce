// tidespec::exact_linear: a float32 GEMM whose every output is one fma chain over the input features
// in their order, so a row's bits do not depend on how many rows share the call, on the tile it
// falls in or on the thread that computes it: row-invariant by construction, on every CPU.
//
// Why this exists: the library sgemms choose their kernel by the row count, and where they do it
// differs by CPU. On a Sapphire Rapids VM MKL's packed sgemm stays row-invariant from 1 to 1,024
// rows; on an AMD EPYC (Zen 4) it changes kernel after 3 rows and F.linear after 1, so the only
// invariant library choice left there was F.linear on 16-row tiles, which makes a 1-row decode pay
// for 16 rows (3x slower than plain decoding, measured). This kernel costs a decode row one row.
//
// Layout: the weight [out, in] is packed once into panels of VL outputs, wp [P, in, VL] (P =
// ceil(out / VL), the last panel zero-padded; ``models/linear.py`` packs it), so the VL outputs of
// a panel at input feature k are one vector load. A task computes R rows x V panels; its R * V
// accumulators stay in registers while the V panels stream through once for the R rows:
//
//   y[r, o] = fma(x[r, K-1], W[o, K-1], ... fma(x[r, 1], W[o, 1], fma(x[r, 0], W[o, 0], 0)) ...)
//
// for every (r, o), whatever R, V and the lane o falls in: the tiling changes only which
// independent chains run together. The file is compiled with -ffp-contract=off (kernels.py).
//
// Worked example (K = 2, one output): x = [[1, 2]], W = [[3, 4]] -> y = fma(2, 4, fma(1, 3, 0)) = 11.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t VL = Vec::size();  // outputs per panel
constexpr int64_t REGS = VL == 16 ? 32 : 16;  // vector registers: AVX512 has 32, AVX2 16

// R rows of x (row stride ldx) times V panels from ``wp`` (panel v at wp + v * K * VL) into y (row
// stride ldy), outputs o0 .. o0 + V * VL clipped to n_out.
template <int R, int V>
void tile(const float* x, int64_t ldx, const float* wp, int64_t K, float* y, int64_t ldy, int64_t o0,
          int64_t n_out) {
  Vec acc[R][V];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) {
      acc[r][v] = Vec(0.f);
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    Vec w[V];
    for (int v = 0; v < V; ++v) {
      w[v] = Vec::loadu(wp + (v * K + k) * VL);
    }
    for (int r = 0; r < R; ++r) {
      const Vec xb(x[r * ldx + k]);
      for (int v = 0; v < V; ++v) {
        acc[r][v] = at::vec::fmadd(xb, w[v], acc[r][v]);
      }
    }
  }
  for (int v = 0; v < V; ++v) {
    const int64_t o = o0 + v * VL;
    const int64_t n = std::min<int64_t>(VL, n_out - o);
    if (n <= 0) {
      break;
    }
    for (int r = 0; r < R; ++r) {
      acc[r][v].store(y + r * ldy + o, static_cast<int>(n));
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, int64_t);

template <int R>
TileFn with_panels(int64_t V) {
  switch (V) {
    case 1: return &tile<R, 1>;
    case 2: return &tile<R, 2>;
    case 3: return &tile<R, 3>;
    case 4: return &tile<R, 4>;
    case 5: return &tile<R, 5>;
    case 6: return &tile<R, 6>;
    case 7: return &tile<R, 7>;
    default: return &tile<R, 8>;
  }
}

TileFn pick(int64_t R, int64_t V) {
  switch (R) {
    case 1: return with_panels<1>(V);
    case 2: return with_panels<2>(V);
    case 3: return with_panels<3>(V);
    default: return with_panels<4>(V);
  }
}

// x [T, K] float32, wp [P, K, VL] float32 (the packed weight), n_out <= P * VL -> [T, n_out].
at::Tensor exact_linear(const at::Tensor& x, const at::Tensor& wp, int64_t n_out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "exact_linear: x must be [T, in] float32");
  TORCH_CHECK(wp.dim() == 3 && wp.scalar_type() == at::kFloat && wp.size(2) == VL && wp.size(1) == x.size(1)
                  && wp.is_contiguous(), "exact_linear: wp must be a contiguous [P, in, ", VL, "] float32 packing");
  TORCH_CHECK(n_out > (wp.size(0) - 1) * VL && n_out <= wp.size(0) * VL, "exact_linear: n_out does not match wp");
  const at::Tensor xc = x.contiguous();
  const int64_t T = xc.size(0), K = xc.size(1), P = wp.size(0);
  at::Tensor y = at::empty({T, n_out}, xc.options());
  if (T == 0) {
    return y;
  }
  // rows and panels per task: a row alone needs 8 independent chains to hide the fma latency; more
  // rows share each panel load, with R * V accumulators + V panel vectors + 1 broadcast in registers
  const int64_t R = std::min<int64_t>(T, 4);
  const int64_t V = std::min<int64_t>(8, (REGS - 1) / (R + 1));
  const float* xp = xc.data_ptr<float>();
  const float* wpp = wp.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tasks = (P + V - 1) / V;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p0 = t * V, v = std::min<int64_t>(V, P - p0);
      for (int64_t r0 = 0; r0 < T; r0 += R) {
        const int64_t r = std::min<int64_t>(R, T - r0);
        pick(r, v)(xp + r0 * K, K, wpp + p0 * K * VL, K, yp + r0 * n_out, n_out, p0 * VL, n_out);
      }
    }
  });
  return y;
}

int64_t exact_linear_lanes() { return VL; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tidespec, m) {
  m.def("exact_linear(Tensor x, Tensor wp, int n_out) -> Tensor");
  m.def("exact_linear_lanes() -> int", &exact_linear_lanes);  // no tensor to dispatch on: one kernel
}

TORCH_LIBRARY_IMPL(tidespec, CPU, m) {
  m.impl("exact_linear", &exact_linear);
}
