// SlotModel's decoder layers as one C++ loop over the kernels of this folder (memfit/runtime/fast_stack.py says when it
// is used). Why: the Python loop dispatched ~25 ops a layer. Same-process A/B on the serving benchmark's 33.7M
// Llama, decode step Python loop vs this: batch 1 4-bit 3.80 vs 2.46 ms, fp32 7.41 vs 5.82; batch 16 0.87x;
// outputs bit-equal.
#include <torch/extension.h>

#include "common.h"
#include "stack.h"

namespace memfit {

namespace {

c10::optional<at::Tensor> opt(const at::Tensor& t) { return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt; }

// with `residual` defined: residual + the Linear's output (in the panel kernel's store, else one add)
at::Tensor run_linear(const LinearSpec& l, const at::Tensor& x, const at::Tensor& residual = at::Tensor()) {
  switch (l.kind) {
    case kPanel:
    case kPanelSiluPairs:
      return linear_panels(x, l.a, opt(l.b), l.kind == kPanelSiluPairs, opt(l.c), opt(residual));
    case kInt4: {
      auto y = int4_linear(x, l.a, l.b, l.group, l.block, false);
      if (l.c.defined()) y.add_(l.c);
      return residual.defined() ? y.add_(residual) : y;
    }
    case kInt4GateUp:  // [gate | up] in one int4 call, silu(gate) * up out
      return int4_linear(x, l.a, l.b, l.group, l.block, true);
  }
  TORCH_CHECK(false, "unknown linear kind ", l.kind);
}

}  // namespace

LayerStack::LayerStack(std::vector<at::Tensor> norm_in, std::vector<at::Tensor> norm_post, double eps,
                       std::vector<int64_t> kinds, std::vector<at::Tensor> a, std::vector<at::Tensor> b,
                       std::vector<at::Tensor> c, std::vector<int64_t> groups, std::vector<int64_t> blocks,
                       std::vector<at::Tensor> k_cache, std::vector<at::Tensor> v_cache, int64_t heads,
                       int64_t kv_heads, int64_t head_dim, double scale)
    : norm_in_(std::move(norm_in)), norm_post_(std::move(norm_post)), eps_(eps), kc_(std::move(k_cache)),
      vc_(std::move(v_cache)), H_(heads), KV_(kv_heads), D_(head_dim), scale_(scale) {
  const size_t L = norm_in_.size();
  TORCH_CHECK(norm_post_.size() == L && kc_.size() == L && vc_.size() == L && kinds.size() == 4 * L &&
                  a.size() == 4 * L && b.size() == 4 * L && c.size() == 4 * L && groups.size() == 4 * L &&
                  blocks.size() == 4 * L,
              "LayerStack: 4 linears (qkv, o, gate_up, down) and 2 norms per layer");
  for (size_t i = 0; i < 4 * L; ++i) {
    auto none = [](const at::Tensor& t) { return t.numel() == 0 ? at::Tensor() : t; };
    linears_.push_back(LinearSpec{kinds[i], a[i], none(b[i]), none(c[i]), groups[i], blocks[i]});
  }
}

at::Tensor LayerStack::forward(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                               const at::Tensor& positions, const at::Tensor& dec_tok, const at::Tensor& dec_slots,
                               const at::Tensor& dec_len, bool all_dec, const std::vector<int64_t>& prefill,
                               const at::Tensor& keep) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "h must be contiguous [T, hidden]");
  TORCH_CHECK(prefill.size() % 4 == 0, "prefill: (offset, length, slot, start) per segment");
  const int64_t T = h.size(0), H = H_, KV = KV_, D = D_;
  const bool any_dec = dec_tok.numel() > 0;
  const size_t L = norm_in_.size();
  for (size_t li = 0; li < L; ++li) {
    const LinearSpec* lin = &linears_[4 * li];
    at::Tensor& kc = kc_[li];
    at::Tensor& vc = vc_[li];
    auto x = rms_norm(h, norm_in_[li], eps_);
    auto heads = run_linear(lin[0], x).view({T, H + 2 * KV, D});
    rope_store(heads, cos, sin, H + KV, H, H + KV, kc, vc, slots, positions, c10::nullopt, 0.0, c10::nullopt, 0.0);
    auto q = heads.narrow(1, 0, H);
    at::Tensor out;
    if (all_dec) {
      out = decode_attention(q, kc, vc, dec_slots, dec_len, scale_, 0);
    } else {
      out = at::empty({T, H, D}, h.options());
      if (any_dec) out.index_copy_(0, dec_tok, decode_attention(q.index_select(0, dec_tok), kc, vc, dec_slots,
                                                                dec_len, scale_, 0));
      std::vector<int64_t> ours;  // the chunks prefill_attention takes, in one call (one parallel region)
      for (size_t i = 0; i < prefill.size(); i += 4) {
        const int64_t a = prefill[i], n = prefill[i + 1], slot = prefill[i + 2], start = prefill[i + 3];
        const int64_t end = start + n;
        if (prefill_attention_fits(D, end)) {
          ours.insert(ours.end(), {a, n, slot, start});
          continue;
        }
        auto qp = q.narrow(0, a, n).transpose(0, 1).unsqueeze(0);  // [1, H, n, D]
        auto kp = kc.narrow(0, slot, 1).narrow(2, 0, end);
        auto vp = vc.narrow(0, slot, 1).narrow(2, 0, end);
        auto dst = out.narrow(0, a, n).transpose(0, 1).unsqueeze(0);  // the rows of out, as [1, H, n, D]
        if (start == 0) {
          dst.copy_(at::scaled_dot_product_attention(qp, kp, vp, c10::nullopt, 0.0, true, scale_, KV != H));
        } else {
          // A later chunk sees the cached prefix [0, start) unmasked and itself [start, end) causally. Two
          // flash calls merged by their logsumexp (as vLLM's merge_attn_states) instead of one call with an
          // [n, end] mask: that mask costs a bool tensor plus SDPA's float copy of it (2.5 MB per layer at
          // n=256, end=2048), the largest allocation of a chunk; the split is as fast and equal to 2e-7.
          auto A = at::_scaled_dot_product_flash_attention_for_cpu(qp, kp.narrow(2, 0, start), vp.narrow(2, 0, start),
                                                                   0.0, false, c10::nullopt, scale_);
          auto B = at::_scaled_dot_product_flash_attention_for_cpu(qp, kp.narrow(2, start, n), vp.narrow(2, start, n),
                                                                   0.0, true, c10::nullopt, scale_);
          // softmax over both parts = the parts' outputs weighted by sigmoid(lse_A - lse_B) and its complement
          auto w = at::sigmoid(std::get<1>(A) - std::get<1>(B)).unsqueeze(-1);
          at::lerp_out(dst, std::get<0>(B), std::get<0>(A), w);
        }
      }
      if (!ours.empty()) prefill_attention(q, kc, vc, out, ours, scale_, 0);
    }
    out = out.view({T, H * D});
    if (li + 1 == L && keep.numel() > 0) {
      // the last layer: every token's K/V is in the cache now, and only the `keep` rows (the tokens whose
      // logits the step returns) go on through o_proj and the MLP (as llama.cpp's inp_out_ids); a prefill
      // chunk skips ~8% of its FLOPs here (the last layer's o_proj + MLP over all but its last token)
      out = out.index_select(0, keep);
      h = h.index_select(0, keep);
    }
    h = run_linear(lin[1], out, h);  // h + o_proj(out)
    x = rms_norm(h, norm_post_[li], eps_);
    h = run_linear(lin[3], run_linear(lin[2], x), h);  // h + down(silu(gate) * up)
  }
  return h;
}

void bind_stack(pybind11::module_& m) {
  pybind11::class_<LayerStack>(m, "LayerStack", pybind11::module_local())
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<at::Tensor>, double, std::vector<int64_t>,
                          std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                          std::vector<int64_t>, std::vector<int64_t>, std::vector<at::Tensor>,
                          std::vector<at::Tensor>, int64_t, int64_t, int64_t, double>())
      .def("forward", &LayerStack::forward,
           "the decoder layers over h [T, hidden] (fp32, CPU): the last layer's output rows `keep` "
           "([len(keep), hidden]), all T rows where keep is empty");
}

}  // namespace memfit
