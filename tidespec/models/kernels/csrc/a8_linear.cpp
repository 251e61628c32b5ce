// tidespec::w4a8_linear and tidespec::w8a8_linear: GGUF-style Q4_1 / Q8_0 weights times int8 activations
// with integer dot products, llama.cpp's arithmetic, row-invariant (the arithmetic, the layouts and a worked
// example: a8_tiles.h). A GGUF file's own blocks run on the same tiles in gguf_linear.cpp.

#include "a8_tiles.h"

namespace tidespec_a8 {
namespace {

// x [T, K] float32, packed [N / 16, K / 8, 64] uint8, dm [N / 16, K / 32, 2, 16] float16 -> [T, N] float32.
at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& dm) {
  check_x(x, "w4a8_linear");
  const int64_t K = x.size(1), P = packed.size(0), KB = K / BLOCK;
  check_packed(packed, K, "w4a8_linear");
  TORCH_CHECK(dm.dim() == 4 && dm.scalar_type() == at::kHalf && dm.size(0) == P && dm.size(1) == KB
                  && dm.size(2) == 2 && dm.size(3) == OUTS && dm.is_contiguous(),
              "w4a8_linear: dm must be a contiguous [N / 16, K / 32, 2, 16] float16");
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), P * OUTS}, x.options());
  if (x.size(0) > 0) {
    const c10::Half* d = dm.data_ptr<c10::Half>();
    const Nibbles<c10::Half> w{packed.data_ptr<uint8_t>(), nullptr, d, KB * 2 * OUTS, 2 * OUTS, d + OUTS, KB * 2 * OUTS,
                               2 * OUTS};
    run_nib<c10::Half, 0, 32, 0, true>(xc.data_ptr<float>(), x.size(0), K, w, P * OUTS, y.data_ptr<float>());
  }
  return y;
}

// x [T, K] float32, packed [N / 16, K / 4, 64] int8, scales [N / 16, K / 32, 16] float16 (w8a8) or float32
// (a GGUF's Q8_0), corr of the same shape int32 -> [T, N] float32.
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& corr) {
  check_x(x, "w8a8_linear");
  const int64_t K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kChar && packed.size(1) * 4 == K && packed.size(2) == 64
                  && packed.is_contiguous(), "w8a8_linear: packed must be a contiguous [N / 16, K / 4, 64] int8");
  const bool half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK(scales.dim() == 3 && (half || scales.scalar_type() == at::kFloat) && scales.size(0) == P
                  && scales.size(1) * BLOCK == K && scales.size(2) == OUTS && scales.is_contiguous(),
              "w8a8_linear: scales must be a contiguous [N / 16, K / 32, 16] float16 or float32");
  TORCH_CHECK(corr.sizes() == scales.sizes() && corr.scalar_type() == at::kInt && corr.is_contiguous(),
              "w8a8_linear: corr must be a contiguous int32 of the scales' shape");
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), P * OUTS}, x.options());
  if (x.size(0) > 0) {
    const float* xp = xc.data_ptr<float>();
    if (half) {
      run_w8(xp, x.size(0), K, packed.data_ptr<int8_t>(), scales.data_ptr<c10::Half>(), corr.data_ptr<int32_t>(),
             P * OUTS, y.data_ptr<float>());
    } else {
      run_w8(xp, x.size(0), K, packed.data_ptr<int8_t>(), scales.data_ptr<float>(), corr.data_ptr<int32_t>(),
             P * OUTS, y.data_ptr<float>());
    }
  }
  return y;
}

bool a8_linear_available() { return vnni_here(); }

}  // namespace
}  // namespace tidespec_a8
TORCH_LIBRARY_FRAGMENT(tidespec, m) {
  m.def("w4a8_linear(Tensor x, Tensor packed, Tensor dm) -> Tensor");
  m.def("w8a8_linear(Tensor x, Tensor packed, Tensor scales, Tensor corr) -> Tensor");
  m.def("a8_linear_available() -> bool", &tidespec_a8::a8_linear_available);
}

TORCH_LIBRARY_IMPL(tidespec, CPU, m) {
  m.impl("w4a8_linear", &tidespec_a8::w4a8_linear);
  m.impl("w8a8_linear", &tidespec_a8::w8a8_linear);
}
