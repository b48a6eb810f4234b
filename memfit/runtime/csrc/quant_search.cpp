// compress's clipping search (compress/quant.py `qparams` with mse): per (row, group) of weights, try the ranges
// p * [min, max] for p = 1, 1 - 1/grid, ... and keep the scale and zero point with the least sum |w - dq(w)|^norm.
//
// Why in C++: torch runs each of the 80 candidates as ~9 passes over the whole weight (and a Sleef pow), 2.5 s per
// 2.6M weights on 2 cores; here a 128-weight group stays in L1 for all its candidates and the power is a
// polynomial log2/exp2 GCC vectorizes (relative error ~2e-6: it only ranks candidates). Same candidates, same
// fp16 rounding of the scale and the same round-half-even codes as the torch loop; a near-tie may pick the other one.
#include <torch/extension.h>

#include <cstring>
#include <limits>

#include "common.h"

// GCC keeps the selects and the float->int conversions below as branches while they may raise FP exceptions
// (-ftrapping-math, the default): the loop stayed scalar, 12x slower. Nothing here reads the exception flags.
#pragma GCC optimize("no-trapping-math")

namespace memfit {

namespace {

// own min/max/abs: under the pragma above, header functions (std::min, std::fabs) are not inlined any more
inline float min_f(float a, float b) { return a < b ? a : b; }
inline float max_f(float a, float b) { return a > b ? a : b; }
inline float abs_f(float a) { return a < 0.f ? -a : a; }

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);  // not __builtin_bit_cast: GCC 11+ only; this vectorizes the same
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// |x|^e for x >= 0 as exp2(e * log2(x)); 0 for x below 1e-30. Polynomials: log2 on the mantissa [1, 2) and 2^f on
// [0, 1), fitted by least squares (abs error 2.5e-6 and 1.2e-7), with no libm call so the loop vectorizes.
inline float fast_pow(float x, float e) {
  const uint32_t u = float_to_bits(x);
  const float k = static_cast<float>(static_cast<int32_t>(u >> 23) - 127);
  const float m = bits_to_float((u & 0x007fffffu) | 0x3f800000u) - 1.f;  // [0, 1)
  const float lm = m * (1.4425348f + m * (-0.7180332f + m * (0.4571561f + m * (-0.2773372f + m * (0.1214685f +
                   m * -0.0257907f)))));
  const float y = max_f(e * (k + lm), -126.f);
  const int32_t n = static_cast<int32_t>(y + 127.f) - 127;  // floor(y) for y >= -127
  const float f = y - static_cast<float>(n);
  const float pf = 1.f + f * (0.6931525f + f * (0.2401524f + f * (0.0558366f + f * (0.0089728f + f * 0.0018854f))));
  const float r = pf * bits_to_float(static_cast<uint32_t>(n + 127) << 23);
  return x < 1e-30f ? 0.f : r;
}

// round half to even for |x| < 2^22 (torch.round's rule), in plain arithmetic so it vectorizes
inline float round_even(float x) {
  const float magic = 12582912.f;  // 1.5 * 2^23
  return (x + magic) - magic;
}

// compress/quant.py `_range_params` for one range
inline void range_params(float wmin, float wmax, int64_t bits, bool sym, float& scale, float& zero) {
  const float maxq = static_cast<float>((1 << bits) - 1);
  if (sym) {
    scale = max_f(-wmin, wmax) / (maxq / 2.f);
    scale = scale > 0.f ? scale : 1.f;
    scale = static_cast<float>(c10::Half(scale));
    zero = static_cast<float>(1 << (bits - 1));
  } else {
    scale = (wmax - wmin) / maxq;
    scale = scale > 0.f ? scale : 1.f;
    scale = max_f(static_cast<float>(c10::Half(scale)), 6.2e-5f);
    zero = min_f(max_f(round_even(-wmin / scale), 0.f), maxq);
  }
}

// sum |dequant(quant(x)) - x|^e over one group
inline float group_error(const float* __restrict x, int64_t g, float s, float z, float maxq, float e) {
  float err = 0.f;
#pragma omp simd reduction(+ : err)
  for (int64_t j = 0; j < g; ++j) {
    const float q = min_f(max_f(round_even(x[j] / s) + z, 0.f), maxq);
    err += fast_pow(abs_f((q - z) * s - x[j]), e);
  }
  return err;
}

// one group's search: the first candidate with the least error wins (the torch loop's `err < best`)
void search_group(const float* __restrict x, int64_t g, int64_t bits, bool sym, int64_t steps, double grid, float e,
                  float* scale, float* zero) {
  float wmin = 0.f, wmax = 0.f;
  for (int64_t j = 0; j < g; ++j) {
    wmin = min_f(wmin, x[j]);
    wmax = max_f(wmax, x[j]);
  }
  const float maxq = static_cast<float>((1 << bits) - 1);
  float best = std::numeric_limits<float>::infinity(), best_s = 1.f, best_z = 0.f;
  for (int64_t i = 0; i < steps; ++i) {
    const float p = static_cast<float>(1.0 - static_cast<double>(i) / grid);
    float s, z;
    range_params(p * wmin, p * wmax, bits, sym, s, z);
    const float err = group_error(x, g, s, z, maxq, e);
    if (err < best) {
      best = err;
      best_s = s;
      best_z = z;
    }
  }
  *scale = best_s;
  *zero = best_z;
}

}  // namespace

// wg [rows, group] fp32: the chosen (scale, zero) per row, each [rows] fp32, over `steps` candidates p = 1 - i / grid.
std::vector<at::Tensor> mse_qparams(const at::Tensor& wg_in, int64_t bits, bool sym, int64_t steps, double grid,
                                    double norm) {
  check_f32_cpu(wg_in, "wg");
  TORCH_CHECK(wg_in.dim() == 2, "wg must be [rows, group]");
  TORCH_CHECK(bits >= 1 && bits <= 8 && steps >= 1 && grid > 0, "bad bits / steps / grid");
  auto wg = wg_in.contiguous();
  const int64_t rows = wg.size(0), g = wg.size(1);
  auto scale = at::empty({rows}, wg.options());
  auto zero = at::empty({rows}, wg.options());
  const float* w = wg.data_ptr<float>();
  float* so = scale.data_ptr<float>();
  float* zo = zero.data_ptr<float>();
  const float e = static_cast<float>(norm);
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) search_group(w + r * g, g, bits, sym, steps, grid, e, so + r, zo + r);
  });
  return {scale, zero};
}

}  // namespace memfit
