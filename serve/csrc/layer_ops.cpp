// Per-layer glue of SlotModel's forward: RMSNorm, RoPE + KV cache write, decode attention; and the Python module.
#include <torch/extension.h>

#include "common.h"
#include "stack.h"

namespace memfit {

namespace {

// the slot caches both kernels read or write: fp32, contiguous, the same [B, KV, S, D] with D = head_dim
void check_caches(const at::Tensor& kc, const at::Tensor& vc, int64_t head_dim) {
  check_f32_cpu(kc, "k_cache");
  check_f32_cpu(vc, "v_cache");
  TORCH_CHECK(kc.dim() == 4 && kc.is_contiguous() && vc.is_contiguous() && vc.sizes() == kc.sizes(),
              "caches must be contiguous [B, KV, S, D], both the same");
  TORCH_CHECK(kc.size(3) == head_dim, "head_dim mismatch");
}

// an index tensor as n contiguous int64 values, each checked against [lo, hi)
at::Tensor checked_indices(const at::Tensor& t, int64_t n, int64_t lo, int64_t hi, const char* name) {
  auto r = t.to(at::kLong).contiguous();
  TORCH_CHECK(r.numel() == n, name, " must have one entry per row");
  const int64_t* p = r.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(p[i] >= lo && p[i] < hi, name, " out of range");
  return r;
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

namespace {

inline float hsum(v16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// softmax in place over p[0, L): the max, then exp and the sum 16 at a time (the tail in a padded vector)
inline void softmax_row(float* p, int64_t L) {
  float m = p[0];
  for (int64_t l = 1; l < L; ++l) m = std::max(m, p[l]);
  v16 vs = {};
  int64_t l = 0;
  for (; l + 16 <= L; l += 16) {
    const v16 e = vexp(*reinterpret_cast<const v16u*>(p + l) - m);
    *reinterpret_cast<v16u*>(p + l) = e;
    vs += e;
  }
  float sum = hsum(vs);
  if (l < L) {
    v16 t;
    for (int i = 0; i < 16; ++i) t[i] = l + i < L ? p[l + i] - m : -100.f;
    t = vexp(t);
    for (int64_t i = 0; l + i < L; ++i) {
      p[l + i] = t[i];
      sum += t[i];
    }
  }
  const float inv = 1.f / sum;
  for (int64_t i = 0; i < L; ++i) p[i] *= inv;
}

// one (sequence, KV head) work item with D a multiple of 16: the G query rows' 16-float slices and output
// accumulators stay in vectors, each key / value row is loaded once for all G, and exp runs 16 lanes at a time
// (replaced a scalar std::exp loop; alternating runs of the two builds, batch 16 at 100 positions, cold caches:
// ~240-285 vs ~190-270 us a layer, noisy; the decode attention reads its K/V rows near memory bandwidth)
void attend_vec(const float* const* qs, const float* K, const float* V, int64_t L, int64_t G, int64_t D,
                float sc, float* const* outs, std::vector<float>& p, std::vector<v16>& acc) {
  const int64_t nd = D / 16;
  p.resize(G * L);
  acc.assign(G * nd, v16{});
  for (int64_t l = 0; l < L; ++l) {
    const v16u* kr = reinterpret_cast<const v16u*>(K + l * D);
    for (int64_t j = 0; j < G; ++j) {
      const v16u* qr = reinterpret_cast<const v16u*>(qs[j]);
      v16 a = qr[0] * kr[0];
      for (int64_t d = 1; d < nd; ++d) a += qr[d] * kr[d];
      p[j * L + l] = hsum(a) * sc;
    }
  }
  for (int64_t j = 0; j < G; ++j) softmax_row(p.data() + j * L, L);
  for (int64_t l = 0; l < L; ++l) {
    const v16u* vr = reinterpret_cast<const v16u*>(V + l * D);
    for (int64_t j = 0; j < G; ++j) {
      const float pl = p[j * L + l];
      v16* o = acc.data() + j * nd;
      for (int64_t d = 0; d < nd; ++d) o[d] += pl * vr[d];
    }
  }
  for (int64_t j = 0; j < G; ++j)
    for (int64_t d = 0; d < nd; ++d) *reinterpret_cast<v16u*>(outs[j] + d * 16) = acc[j * nd + d];
}

// the same for any D, one element at a time
void attend_scalar(const float* const* qs, const float* K, const float* V, int64_t L, int64_t G, int64_t D,
                   float sc, float* const* outs, std::vector<float>& p) {
  p.resize(G * L);
  for (int64_t l = 0; l < L; ++l)
    for (int64_t j = 0; j < G; ++j) {
      float a = 0.f;
      for (int64_t d = 0; d < D; ++d) a += qs[j][d] * K[l * D + d];
      p[j * L + l] = a * sc;
    }
  for (int64_t j = 0; j < G; ++j) softmax_row(p.data() + j * L, L);
  for (int64_t j = 0; j < G; ++j) {
    std::fill_n(outs[j], D, 0.f);
    for (int64_t l = 0; l < L; ++l)
      for (int64_t d = 0; d < D; ++d) outs[j][d] += p[j * L + l] * V[l * D + d];
  }
}

}  // namespace

// One query token per sequence: out[i, h] = softmax(q[i, h] . K[slot_i, h / G, :len_i] * scale) V[...].
// q [n, H, D] (last dim contiguous), caches [B, KV, S, D]; G = H / KV query heads share a KV head, so each
// key and value row is loaded once for the G of them.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& slots,
                            const at::Tensor& lens, double scale) {
  check_f32_cpu(q, "q");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [n, H, D] with a contiguous last dim");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), B = kc.size(0), KV = kc.size(1), S = kc.size(2);
  check_caches(kc, vc, D);
  TORCH_CHECK(H % KV == 0, "query heads must be a multiple of the KV heads");
  const int64_t G = H / KV;
  auto sl = checked_indices(slots, n, 0, B, "slot");
  auto ln = checked_indices(lens, n, 1, S + 1, "length");
  const int64_t* slp = sl.data_ptr<int64_t>();
  const int64_t* lnp = ln.data_ptr<int64_t>();
  auto out = at::empty({n, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t sq0 = q.stride(0), sq1 = q.stride(1);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, n * KV, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> p;
    std::vector<v16> acc;
    std::vector<const float*> qs(G);
    std::vector<float*> outs(G);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t i = w / KV, g = w % KV;
      const float* K = kp + ((slp[i] * KV + g) * S) * D;
      const float* V = vp + ((slp[i] * KV + g) * S) * D;
      for (int64_t j = 0; j < G; ++j) {
        qs[j] = qp + i * sq0 + (g * G + j) * sq1;
        outs[j] = op + (i * H + g * G + j) * D;
      }
      if (D % 16 == 0)
        attend_vec(qs.data(), K, V, lnp[i], G, D, sc, outs.data(), p, acc);
      else
        attend_scalar(qs.data(), K, V, lnp[i], G, D, sc, outs.data(), p);
    }
  });
  return out;
}

}  // namespace memfit

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  memfit::bind_stack(m);
  m.def("pack_panels", &memfit::pack_panels, "an fp32 Linear weight [N, K] in linear_panels' layout [N / 16, K, 16]");
  m.def("linear_panels", &memfit::linear_panels, "x @ W^T (+ bias) on a pack_panels weight (fp32)", py::arg("x"),
        py::arg("packed"), py::arg("bias") = py::none(), py::arg("silu_mul") = false,
        py::arg("scale") = py::none());
  m.def("rms_norm", &memfit::rms_norm, "fused RMSNorm over the last dim (fp32)");
  m.def("rope_store", &memfit::rope_store, "in-place RoPE on q/k heads, then k/v into the slot caches (fp32)");
  m.def("int4_linear", &memfit::int4_linear, "x @ W^T on torch's CPU int4 pack with B-row blocks (fp32 x and y)",
        py::arg("x"), py::arg("packed"), py::arg("scale_zeros"), py::arg("group_size"), py::arg("block"),
        py::arg("silu_mul") = false);
  m.def("decode_attention", &memfit::decode_attention, "one-token-per-sequence attention over the slot caches (fp32)");
}
