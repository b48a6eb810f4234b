// Per-layer glue of SlotModel's forward: RMSNorm, RoPE + KV cache write (attention: attention.cpp); and the Python
// module.
#include <torch/extension.h>

#include "common.h"
#include "stack.h"

namespace memfit {

// y = x / sqrt(mean(x^2) + eps) * w over the last dimension (as torch.nn.functional.rms_norm).
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w, double eps) {
  check_f32_cpu(x_in, "x");
  check_f32_cpu(w, "w");
  auto x = x_in.contiguous();
  const int64_t n = x.size(-1);
  TORCH_CHECK(w.numel() == n && w.is_contiguous(), "w must be contiguous with x's last size");
  const int64_t rows = x.numel() / n;
  auto y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * n;
      float* yr = yp + r * n;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) ss += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) yr[i] = xr[i] * inv * wp[i];
    }
  });
  return y;
}

// RoPE (HF's rotate_half form) in place on the first `rope_heads` heads of qkv [T, heads, D] (last dim
// contiguous), then k = heads [k0, k0 + KV) and v = heads [v0, v0 + KV) are stored into the caches
// [B, KV, S, D] at (slots[t], :, positions[t]).
void rope_store(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t rope_heads, int64_t k0,
                int64_t v0, at::Tensor& kc, at::Tensor& vc, const at::Tensor& slots, const at::Tensor& positions) {
  check_f32_cpu(qkv, "qkv");
  TORCH_CHECK(qkv.dim() == 3 && qkv.stride(2) == 1, "qkv must be [T, heads, D] with a contiguous last dim");
  const int64_t T = qkv.size(0), D = qkv.size(2), KV = kc.size(1), S = kc.size(2), B = kc.size(0);
  TORCH_CHECK(D % 2 == 0, "head_dim must be even");
  check_caches(kc, vc, D);
  auto c = cos.reshape({T, D}).contiguous();
  auto s = sin.reshape({T, D}).contiguous();
  check_f32_cpu(c, "cos");
  check_f32_cpu(s, "sin");
  auto sl = checked_indices(slots, T, 0, B, "slot");
  auto ps = checked_indices(positions, T, 0, S, "position");
  const int64_t* slp = sl.data_ptr<int64_t>();
  const int64_t* psp = ps.data_ptr<int64_t>();
  float* base = qkv.data_ptr<float>();
  const int64_t st = qkv.stride(0), sh = qkv.stride(1), half = D / 2;
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  float* kcp = kc.data_ptr<float>();
  float* vcp = vc.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    std::vector<float> tmp(D);
    for (int64_t t = t0; t < t1; ++t) {
      const float* ct = cp + t * D;
      const float* stt = sp + t * D;
      for (int64_t h = 0; h < rope_heads; ++h) {
        float* x = base + t * st + h * sh;
        // as torch evaluates x * cos + rotate_half(x) * sin: two rounded products, then one add
        for (int64_t i = 0; i < half; ++i) {
          tmp[i] = x[i] * ct[i] + (-x[i + half]) * stt[i];
          tmp[i + half] = x[i + half] * ct[i + half] + x[i] * stt[i + half];
        }
        std::copy(tmp.begin(), tmp.end(), x);
      }
      const int64_t off = ((slp[t] * KV) * S + psp[t]) * D;
      for (int64_t g = 0; g < KV; ++g) {
        std::copy_n(base + t * st + (k0 + g) * sh, D, kcp + off + g * S * D);
        std::copy_n(base + t * st + (v0 + g) * sh, D, vcp + off + g * S * D);
      }
    }
  });
}

}  // namespace memfit

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  memfit::bind_stack(m);
  m.def("pack_panels", &memfit::pack_panels, "an fp32 Linear weight [N, K] in linear_panels' layout [N / 16, K, 16]");
  m.def("linear_panels", &memfit::linear_panels,
        "x @ W^T (+ bias) on a pack_panels weight (fp32); act 1 / 2: silu / gelu_tanh(gate) * up of panel pairs",
        py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(), py::arg("act") = 0,
        py::arg("scale") = py::none(), py::arg("residual") = py::none());
  m.def("rms_norm", &memfit::rms_norm, "fused RMSNorm over the last dim (fp32)");
  m.def("rope_store", &memfit::rope_store, "in-place RoPE on q/k heads, then k/v into the slot caches (fp32)");
  m.def("int4_linear", &memfit::int4_linear, "x @ W^T on torch's CPU int4 pack with B-row blocks (fp32 x and y)",
        py::arg("x"), py::arg("packed"), py::arg("scale_zeros"), py::arg("group_size"), py::arg("block"),
        py::arg("act") = 0);
  m.def("decode_attention", &memfit::decode_attention, "one-token-per-sequence attention over the slot caches (fp32)");
  m.def("prefill_attention", &memfit::prefill_attention,
        "causal attention of prefill chunks (offset, length, slot, start) over the slot caches into out (fp32)");
  m.def("prefill_attention_fits", &memfit::prefill_attention_fits,
        "whether prefill_attention takes this head_dim and chunk end (else aten's flash kernel)");
}
