// Per-layer glue of SlotModel's forward: RMSNorm, RoPE + KV cache write (attention: attention.cpp); and the Python
// module.
#include <torch/extension.h>

#include "common.h"
#include "stack.h"

namespace memfit {

namespace {

// one row: y = x / sqrt(mean(x^2) + eps) * w (y may be x)
inline void rms_row(const float* x, const float* w, int64_t n, float eps, float* y) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * inv * w[i];
}

// an optional RMSNorm weight over the head dim D, as a pointer (nullptr: none)
const float* head_norm(const c10::optional<at::Tensor>& w, int64_t D, const char* name) {
  if (!w.has_value() || !w->defined()) return nullptr;
  check_f32_cpu(*w, name);
  TORCH_CHECK(w->is_contiguous() && w->numel() == D, name, " must be contiguous [head_dim]");
  return w->data_ptr<float>();
}

}  // namespace

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
    for (int64_t r = r0; r < r1; ++r) rms_row(xp + r * n, wp, n, static_cast<float>(eps), yp + r * n);
  });
  return y;
}

// RoPE (HF's rotate_half form) in place on the first `rope_heads` heads of qkv [T, heads, D] (last dim
// contiguous), then k = heads [k0, k0 + KV) and v = heads [v0, v0 + KV) are stored into the paged caches (common.h:
// KvPages; int8 ones quantized per row into their scales) at (slots[t], positions[t]). With q_norm / k_norm (qwen3, Gemma 3: an RMSNorm over each head,
// weight [D]), the query heads [0, k0) / key heads [k0, rope_heads) are normed in place before their RoPE.
void rope_store(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t rope_heads, int64_t k0,
                int64_t v0, at::Tensor& kc, at::Tensor& vc, const at::Tensor& table, const at::Tensor& slots,
                const at::Tensor& positions, const c10::optional<at::Tensor>& q_norm, double q_eps,
                const c10::optional<at::Tensor>& k_norm, double k_eps, const c10::optional<at::Tensor>& k_scale,
                const c10::optional<at::Tensor>& v_scale) {
  check_f32_cpu(qkv, "qkv");
  TORCH_CHECK(qkv.dim() == 3 && qkv.stride(2) == 1, "qkv must be [T, heads, D] with a contiguous last dim");
  const int64_t T = qkv.size(0), D = qkv.size(2);
  TORCH_CHECK(D % 2 == 0, "head_dim must be even");
  const KvPages kv(kc, vc, table, D, k_scale, v_scale);
  const int64_t KV = kv.KV;
  const float* qn = head_norm(q_norm, D, "q_norm");
  const float* kn = head_norm(k_norm, D, "k_norm");
  auto c = cos.reshape({T, D}).contiguous();
  auto s = sin.reshape({T, D}).contiguous();
  check_f32_cpu(c, "cos");
  check_f32_cpu(s, "sin");
  auto sl = checked_indices(slots, T, 0, kv.slots, "slot");
  auto ps = checked_indices(positions, T, 0, kv.MB * kv.bs, "position");
  const int64_t* slp = sl.data_ptr<int64_t>();
  const int64_t* psp = ps.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) kv.check(slp[t], psp[t]);
  float* base = qkv.data_ptr<float>();
  const int64_t st = qkv.stride(0), sh = qkv.stride(1), half = D / 2;
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    std::vector<float> tmp(D);
    for (int64_t t = t0; t < t1; ++t) {
      const float* ct = cp + t * D;
      const float* stt = sp + t * D;
      for (int64_t h = 0; h < rope_heads; ++h) {
        float* x = base + t * st + h * sh;
        if (const float* nw = h < k0 ? qn : kn) rms_row(x, nw, D, static_cast<float>(h < k0 ? q_eps : k_eps), x);
        // as torch evaluates x * cos + rotate_half(x) * sin: two rounded products, then one add
        for (int64_t i = 0; i < half; ++i) {
          tmp[i] = x[i] * ct[i] + (-x[i + half]) * stt[i];
          tmp[i + half] = x[i + half] * ct[i + half] + x[i] * stt[i + half];
        }
        std::copy(tmp.begin(), tmp.end(), x);
      }
      for (int64_t g = 0; g < KV; ++g) {
        const int64_t off = kv.at(slp[t], g, psp[t]);
        kv.store(false, off, base + t * st + (k0 + g) * sh);
        kv.store(true, off, base + t * st + (v0 + g) * sh);
      }
    }
  });
}

}  // namespace memfit

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  memfit::bind_stack(m);
  m.def("pack_panels", &memfit::pack_panels,
        "a Linear weight [N, K] in linear_panels' layout: fp32 and int8 [N / 16, K, 16], bf16 [N / 16, K / 2, 32]");
  m.def("mse_qparams", &memfit::mse_qparams,
        "compress's clipping search: per row of wg [rows, group], the (scale, zero) of p * [min, max] over p = 1 - i / "
        "grid, i < steps, with the least sum |w - dequant(w)|^norm", py::arg("wg"), py::arg("bits"), py::arg("sym"),
        py::arg("steps"), py::arg("grid"), py::arg("norm"));
  m.def("has_avx512_bf16", &memfit::has_avx512_bf16, "whether these kernels were built with AVX512-BF16");
  m.def("peak_gflops", &memfit::peak_gflops, "peak GFLOPS of a register-only fp32 FMA or vdpbf16ps loop",
        py::arg("bf16"), py::arg("iters") = 2000000);
  m.def("linear_panels", &memfit::linear_panels,
        "x @ W^T (+ bias) on a pack_panels weight (fp32 x and y); act 1 / 2: silu / gelu_tanh(gate) * up of panel "
        "pairs", py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(), py::arg("act") = 0,
        py::arg("scale") = py::none(), py::arg("residual") = py::none(), py::arg("bf16_dot") = false);
  m.def("rms_norm", &memfit::rms_norm, "fused RMSNorm over the last dim (fp32)");
  m.def("rope_store", &memfit::rope_store,
        "in-place RoPE on q/k heads (after their optional per-head RMSNorms), then k/v into the paged caches (fp32)",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("rope_heads"), py::arg("k0"), py::arg("v0"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"), py::arg("slots"), py::arg("positions"),
        py::arg("q_norm") = py::none(), py::arg("q_eps") = 0.0, py::arg("k_norm") = py::none(), py::arg("k_eps") = 0.0,
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none());
  m.def("int4_linear", &memfit::int4_linear, "x @ W^T on torch's CPU int4 pack with B-row blocks (fp32 x and y)",
        py::arg("x"), py::arg("packed"), py::arg("scale_zeros"), py::arg("group_size"), py::arg("block"),
        py::arg("act") = 0, py::arg("bf16_dot") = false);
  m.def("int4_decode_int16", &memfit::int4_decode_int16,
        "whether int4_linear's 1-4 row calls (64-row blocks) round x to int16 per (row, group) for vpdpwssd");
  m.def("decode_attention", &memfit::decode_attention,
        "one-token-per-sequence attention over the paged caches (fp32), within a sliding window unless it is 0",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"), py::arg("slots"), py::arg("lens"), py::arg("scale"),
        py::arg("window") = 0, py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none());
  m.def("prefill_attention", &memfit::prefill_attention,
        "causal attention of prefill chunks (offset, length, slot, start) over the paged caches into out (fp32), "
        "within a sliding window unless it is 0",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"), py::arg("out"), py::arg("segs"), py::arg("scale"),
        py::arg("window") = 0, py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none());
  m.def("prefill_attention_fits", &memfit::prefill_attention_fits,
        "whether prefill_attention takes this head_dim and a chunk reading this many keys (its end, or with a "
        "window its end less the keys before its first row's window; else aten's flash kernel)");
}
