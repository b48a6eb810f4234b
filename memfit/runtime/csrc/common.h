// Shared by memfit/runtime/csrc/*.cpp: the fused CPU kernels of memfit.runtime.kernels (see memfit/runtime/kernels.py for why and how
// they are built).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec16.h"

namespace memfit {

// exp(x) for 16 floats (Cephes' expf: 2^n times a degree-6 polynomial, ~1 ulp); GCC's std::exp stayed scalar
inline v16 vexp(v16 x) {
  x = vmax(vmin(x, 88.37f), -87.33f);
  v16 fx = x * 1.44269504088896341f + 0.5f;
  const v16 n = vfloor_from_trunc(to_f32(to_i32(fx)), fx);
  const v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  v16 p = 1.9875691500e-4f * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * bits_f32((to_i32(n) + 127) << 23);  // 2^n
}

// A gated MLP's activation, applied in a Linear's epilogue to (gate, up) pairs: y = act(gate) * up
// (memfit.runtime.linear.ACTS names them for Python).
enum Act : int64_t { kNoAct = 0, kSilu = 1, kGeluTanh = 2 };

// act(g) * u for 16 lanes. GELU-tanh is 0.5 g (1 + tanh(u)) with u = sqrt(2 / pi) (g + 0.044715 g^3), computed as
// g / (1 + exp(-2 u)): the same function (0.5 (1 + tanh(u)) = sigmoid(2 u)), without the cancellation of
// 1 + tanh(u) where u is negative; within ~1e-7 relative of torch's gelu(approximate='tanh') where that is exact.
template <int ACT>
inline v16 act_mul(v16 g, v16 u) {
  static_assert(ACT == kSilu || ACT == kGeluTanh, "act_mul: silu or gelu_tanh");
  if constexpr (ACT == kSilu) {
    return g / (1.f + vexp(-g)) * u;
  } else {
    constexpr float c = -1.5957691216057308f;  // -2 sqrt(2 / pi)
    return g / (1.f + vexp(g * (c + (c * 0.044715f) * g * g))) * u;
  }
}

inline void check_f32_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a CPU float32 tensor");
}

// The KV caches the attention kernels read and rope_store writes, paged: per layer K and V [num_blocks, KV, bs, D]
// (contiguous, the same) and a block table [slots, max_blocks] (int64): position p of the sequence in slot s is
// row p % bs of block table[s, p / bs]. The static slot cache is the case bs = max_seq_len, table[s, 0] = s.
// The caches are fp32, or int8 with a scale per (block, KV head, row) ([num_blocks, KV, bs] fp32): a row is
// q * scale, q = round(x / scale), scale = max|x| / 127 (symmetric, per token and head, as llama.cpp's q8_0 KV
// per 32 values and vLLM's per-token-head int8 KV). `span` / `check` check a slot's blocks once per call; the
// accessors after them do not.
struct KvPages {
  float *k = nullptr, *v = nullptr;     // fp32 caches
  int8_t *k8 = nullptr, *v8 = nullptr;  // int8 caches
  float *ks = nullptr, *vs = nullptr;   // and their scales: row offset `at` has scale ks[at / D]
  const int64_t* tab;
  int64_t slots, MB, NB, KV, bs, D;
  bool q8;
  at::Tensor table;  // the contiguous int64 table the pointer reads

  KvPages(const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& table_in, int64_t head_dim,
          const c10::optional<at::Tensor>& k_scale = c10::nullopt,
          const c10::optional<at::Tensor>& v_scale = c10::nullopt) {
    TORCH_CHECK(kc.dim() == 4 && kc.is_contiguous() && vc.is_contiguous() && vc.sizes() == kc.sizes() &&
                    kc.device().is_cpu() && vc.device().is_cpu() && kc.scalar_type() == vc.scalar_type(),
                "caches must be contiguous CPU [blocks, KV, block_size, D], both the same");
    TORCH_CHECK(kc.size(3) == head_dim, "head_dim mismatch");
    TORCH_CHECK(table_in.dim() == 2 && table_in.device().is_cpu(), "block table must be [slots, max_blocks] on CPU");
    q8 = kc.scalar_type() == at::kChar;
    TORCH_CHECK(q8 || kc.scalar_type() == at::kFloat, "caches must be float32 or int8");
    const bool scales = k_scale.has_value() && k_scale->defined() && v_scale.has_value() && v_scale->defined();
    TORCH_CHECK(scales == q8, "int8 caches need k_scale and v_scale (and fp32 caches none)");
    if (q8) {
      for (const at::Tensor* t : {&*k_scale, &*v_scale}) {
        check_f32_cpu(*t, "kv scale");
        TORCH_CHECK(t->is_contiguous() && t->sizes() == kc.sizes().slice(0, 3), "scales must be [blocks, KV, bs]");
      }
      k8 = kc.data_ptr<int8_t>(), v8 = vc.data_ptr<int8_t>();
      ks = k_scale->data_ptr<float>(), vs = v_scale->data_ptr<float>();
    } else {
      k = kc.data_ptr<float>(), v = vc.data_ptr<float>();
    }
    table = table_in.to(at::kLong).contiguous();
    tab = table.data_ptr<int64_t>();
    slots = table.size(0), MB = table.size(1), NB = kc.size(0), KV = kc.size(1), bs = kc.size(2), D = head_dim;
  }
  // positions [0, end) of `slot` are covered by valid blocks
  void span(int64_t slot, int64_t end) const {
    TORCH_CHECK(slot >= 0 && slot < slots, "slot out of range");
    TORCH_CHECK(end >= 0 && end <= MB * bs, "position out of range");
    for (int64_t b = 0; b * bs < end; ++b)
      TORCH_CHECK(tab[slot * MB + b] >= 0 && tab[slot * MB + b] < NB, "block table entry out of range");
  }
  // position p of `slot` is in a valid block
  void check(int64_t slot, int64_t p) const {
    TORCH_CHECK(slot >= 0 && slot < slots && p >= 0 && p < MB * bs, "KV position out of range");
    const int64_t b = tab[slot * MB + p / bs];
    TORCH_CHECK(b >= 0 && b < NB, "block table entry out of range");
  }
  // element offset of (slot, KV head g, position p) in the caches
  int64_t at(int64_t slot, int64_t g, int64_t p) const { return ((tab[slot * MB + p / bs] * KV + g) * bs + p % bs) * D; }
  // write one row (D floats) of K or V at offset `off` (int8: quantized, with its scale)
  void store(bool value, int64_t off, const float* x) const {
    if (!q8) {
      std::copy_n(x, D, (value ? v : k) + off);
      return;
    }
    float amax = 0.f;
    for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
    const float sc = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int8_t* dst = (value ? v8 : k8) + off;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<int8_t>(std::nearbyint(x[d] * inv));
    (value ? vs : ks)[off / D] = sc;
  }
  // read one row of K or V at offset `off` as D floats
  void load(bool value, int64_t off, float* y) const {
    if (!q8) {
      std::copy_n((value ? v : k) + off, D, y);
      return;
    }
    const int8_t* src = (value ? v8 : k8) + off;
    const float sc = (value ? vs : ks)[off / D];
    for (int64_t d = 0; d < D; ++d) y[d] = static_cast<float>(src[d]) * sc;
  }
};

// an index tensor as n contiguous int64 values, each checked against [lo, hi)
inline at::Tensor checked_indices(const at::Tensor& t, int64_t n, int64_t lo, int64_t hi, const char* name) {
  auto r = t.to(at::kLong).contiguous();
  TORCH_CHECK(r.numel() == n, name, " must have one entry per row");
  const int64_t* p = r.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(p[i] >= lo && p[i] < hi, name, " out of range");
  return r;
}

// rows from which bf16 panels, int8 panels in bf16 mode (bf16_dot) and int4's bf16_dot tiles take vdpbf16ps (x
// rounded to bf16) instead of fp32 FMAs
constexpr int64_t kDpbf16MinRows = 8;

// cpu_peak.cpp
bool has_avx512_bf16();
double peak_gflops(bool bf16, int64_t iters);

// x rounded to bf16 (nearest even) once per call and read as k pairs (p) by the vdpbf16ps kernels, where they run:
// an AVX512-BF16 build, `use` (the weight format and the caller's mode allow it), at least kDpbf16MinRows rows;
// else p is null and the fp32 FMA paths run
struct Bf16Pairs {
  at::Tensor t;
  const uint32_t* p = nullptr;
  Bf16Pairs(const at::Tensor& x, int64_t rows, bool use) {
    if (use && has_avx512_bf16() && rows >= kDpbf16MinRows) {
      t = x.to(at::kBFloat16);
      p = reinterpret_cast<const uint32_t*>(t.data_ptr<at::BFloat16>());
    }
  }
};

// layer_ops.cpp
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w, double eps);
void rope_store(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t rope_heads, int64_t k0,
                int64_t v0, at::Tensor& kc, at::Tensor& vc, const at::Tensor& table, const at::Tensor& slots,
                const at::Tensor& positions,
                const c10::optional<at::Tensor>& q_norm, double q_eps, const c10::optional<at::Tensor>& k_norm,
                double k_eps, const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale);

// attention.cpp
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& table,
                            const at::Tensor& slots, const at::Tensor& lens, double scale, int64_t window,
                            const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale);
bool prefill_attention_fits(int64_t head_dim, int64_t keys);
int64_t first_key(int64_t start, int64_t window);
void prefill_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& table,
                       at::Tensor& out, const std::vector<int64_t>& segs, double scale, int64_t window,
                       const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale);

// linear.cpp
at::Tensor pack_panels(const at::Tensor& w);
std::vector<at::Tensor> mse_qparams(const at::Tensor& wg_in, int64_t bits, bool sym, int64_t steps, double grid,
                                    double norm);
at::Tensor linear_panels(const at::Tensor& x_in, const at::Tensor& P, const c10::optional<at::Tensor>& bias,
                         int64_t act, const c10::optional<at::Tensor>& scale,
                         const c10::optional<at::Tensor>& residual, bool bf16_dot = false);
at::Tensor int4_linear(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale_zeros,
                       int64_t group_size, int64_t block, int64_t act, bool bf16_dot = false);
bool int4_decode_int16();

}  // namespace memfit
