// tidespec::gguf_nib_linear: a GGUF file's own blocks (models/quant/gguf_blocks.py, --quantization gguf) on
// the a8 kernels' nibble tile: Q4_0/1/K, Q5_0, Q5_1/K, Q3_K and Q6_K with their scales as the file holds
// them (the arithmetic and layouts: a8_tiles.h). Its own file so that a8_linear.cpp stays one subject.

#include <optional>
#include <tuple>
#include <type_traits>

#include "a8_tiles.h"

namespace tidespec_a8 {
namespace {

// The (HB, SUB, offset, mins) tiles of Q4_0/1/K, Q5_0, Q5_1/K, Q3_K and Q6_K for scales of type S (float32
// for any type; float16 for the legacy types; int8 codes for the K-quants); any other a one-line error.
template <typename S>
void run_gguf_nib(const float* xp, int64_t R, int64_t K, const Nibbles<S>& w, int64_t N, float* yp, int64_t hb,
                  int64_t sub, int64_t offset, bool m) {
  constexpr bool legacy = !std::is_same_v<S, int8_t>, kquant = !std::is_same_v<S, c10::Half>;
  if (hb == 0 && sub == 32 && offset == 0 && m) {
    return run_nib<S, 0, 32, 0, true>(xp, R, K, w, N, yp);  // Q4_0, Q4_1, Q4_K
  }
  if (hb == 1 && sub == 32 && offset == 0 && m) {
    return run_nib<S, 1, 32, 0, true>(xp, R, K, w, N, yp);  // Q5_1, Q5_K
  }
  if constexpr (legacy) {
    if (hb == 1 && sub == 32 && offset == 16 && !m) {
      return run_nib<S, 1, 32, 16, false>(xp, R, K, w, N, yp);  // Q5_0
    }
  }
  if constexpr (kquant) {
    if (hb == 0 && sub == 16 && offset == 4 && !m) {
      return run_nib<S, 0, 16, 4, false>(xp, R, K, w, N, yp);  // Q3_K
    }
    if (hb == 2 && sub == 16 && offset == 32 && !m) {
      return run_nib<S, 2, 16, 32, false>(xp, R, K, w, N, yp);  // Q6_K
    }
  }
  TORCH_CHECK(false, "gguf_nib_linear: no tile for ", hb, " high planes, scales per ", sub, ", offset ", offset,
              m ? ", mins" : ", no mins", " with ", std::is_same_v<S, int8_t> ? "int8 codes" : "these scales");
}

void check_values(const at::Tensor& t, int64_t P, int64_t per, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.size(0) == P && t.size(1) == per && t.size(2) == OUTS && t.is_contiguous(),
              "gguf_nib_linear: ", name, " must be a contiguous [N / 16, ", per, ", 16] tensor");
}

// A GGUF matrix on the nibble tile (models/quant/gguf_blocks.py): x [T, K] float32, packed [N / 16, K / 8, 64]
// uint8, scales [N / 16, K / SUB, 16] (SUB 32 or 16), mins None or [N / 16, K / 32, 16], both float32 or
// float16, or both int8 codes with scale_super (and min_super, with mins) [N / 16, K / 256, 16] float16;
// high None or [N / 16, K / 8, HB, 2, 8] uint8 (HB 1 or 2), offset: the codes' -> [T, N] float32.
at::Tensor gguf_nib_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                           const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& high, int64_t offset,
                           const std::optional<at::Tensor>& scale_super, const std::optional<at::Tensor>& min_super) {
  check_x(x, "gguf_nib_linear");
  const int64_t K = x.size(1), P = packed.size(0), KB = K / BLOCK;
  check_packed(packed, K, "gguf_nib_linear");
  const int64_t sub = scales.dim() == 3 && scales.size(1) > 0 ? K / scales.size(1) : 0;
  TORCH_CHECK(sub == 32 || sub == 16, "gguf_nib_linear: scales must hold one value per 32 or 16 inputs");
  check_values(scales, P, K / sub, "scales");
  const auto type = scales.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kHalf || type == at::kChar,
              "gguf_nib_linear: scales must be float32, float16 or int8 codes");
  if (mins.has_value()) {
    check_values(*mins, P, KB, "mins");
    TORCH_CHECK(mins->scalar_type() == type, "gguf_nib_linear: mins must have the scales' dtype");
  }
  const bool codes = type == at::kChar;
  TORCH_CHECK(!codes || K % 256 == 0, "gguf_nib_linear: int8 codes need whole 256-input super-blocks");
  for (const auto& [super, present, name] : {std::tuple(scale_super, codes, "scale_super"),
                                             std::tuple(min_super, codes && mins.has_value(), "min_super")}) {
    TORCH_CHECK(super.has_value() == present, "gguf_nib_linear: ", name, present ? " is required with int8 codes"
                                                                           : " goes only with int8 codes");
    if (present) {
      check_values(*super, P, K / 256, name);
      TORCH_CHECK(super->scalar_type() == at::kHalf, "gguf_nib_linear: ", name, " must be float16");
    }
  }
  const int64_t hb = high.has_value() ? high->size(2) : 0;
  if (high.has_value()) {
    TORCH_CHECK(high->scalar_type() == at::kByte && high->dim() == 5 && high->size(0) == P && high->size(1) * 8 == K
                    && (hb == 1 || hb == 2) && high->size(3) == 2 && high->size(4) == 8 && high->is_contiguous(),
                "gguf_nib_linear: high must be a contiguous [N / 16, K / 8, 1 or 2, 2, 8] uint8");
  }
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), P * OUTS}, x.options());
  if (x.size(0) == 0) {
    return y;
  }
  const uint8_t* hp = high.has_value() ? high->data_ptr<uint8_t>() : nullptr;
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t R = x.size(0), N = P * OUTS, panel_s = (K / sub) * OUTS, panel_m = KB * OUTS;
  const bool m = mins.has_value();
  if (type == at::kFloat) {
    const Nibbles<float> w{packed.data_ptr<uint8_t>(), hp, scales.data_ptr<float>(), panel_s, OUTS,
                           m ? mins->data_ptr<float>() : nullptr, panel_m, OUTS};
    run_gguf_nib(xp, R, K, w, N, yp, hb, sub, offset, m);
  } else if (type == at::kHalf) {
    const Nibbles<c10::Half> w{packed.data_ptr<uint8_t>(), hp, scales.data_ptr<c10::Half>(), panel_s, OUTS,
                               m ? mins->data_ptr<c10::Half>() : nullptr, panel_m, OUTS};
    run_gguf_nib(xp, R, K, w, N, yp, hb, sub, offset, m);
  } else {
    const Nibbles<int8_t> w{packed.data_ptr<uint8_t>(), hp, scales.data_ptr<int8_t>(), panel_s, OUTS,
                            m ? mins->data_ptr<int8_t>() : nullptr, panel_m, OUTS, scale_super->data_ptr<c10::Half>(),
                            m ? min_super->data_ptr<c10::Half>() : nullptr, (K / 256) * OUTS};
    run_gguf_nib(xp, R, K, w, N, yp, hb, sub, offset, m);
  }
  return y;
}

}  // namespace
}  // namespace tidespec_a8

TORCH_LIBRARY_FRAGMENT(tidespec, m) {
  m.def("gguf_nib_linear(Tensor x, Tensor packed, Tensor scales, Tensor? mins, Tensor? high, int offset, "
        "Tensor? scale_super=None, Tensor? min_super=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(tidespec, CPU, m) {
  m.impl("gguf_nib_linear", &tidespec_a8::gguf_nib_linear);
}
