// SlotModel's decoder layers as one C++ loop over the kernels of this folder (memfit/runtime/fast_stack.py says when it
// is used). Why: the Python loop dispatched ~25 ops a layer. Same-process A/B on the serving benchmark's 33.7M
// Llama, decode step Python loop vs this: batch 1 4-bit 3.80 vs 2.46 ms, fp32 7.41 vs 5.82; batch 16 0.87x;
// outputs bit-equal. Layers beyond Llama's (stack.h: LayerSpec): q/k norms per head (in rope_store), Gemma's
// sandwich norms, a RoPE table per layer type, sliding windows, GELU-tanh gate/up pairs; GPT-2 / GPT-NeoX's
// LayerNorms, non-gated MLPs and parallel residual.
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
    case kPanelGeluPairs: {
      const int64_t act = l.kind == kPanel ? kNoAct : (l.kind == kPanelSiluPairs ? kSilu : kGeluTanh);
      return linear_panels(x, l.a, opt(l.b), act, opt(l.c), opt(residual), l.bf16_dot);
    }
    case kInt4: {
      auto y = int4_linear(x, l.a, l.b, l.group, l.block, kNoAct, l.bf16_dot);
      if (l.c.defined()) y.add_(l.c);
      return residual.defined() ? y.add_(residual) : y;
    }
    case kInt4GateUp:  // [gate | up] in one int4 call, act(gate) * up out
    case kInt4GateUpGelu:
      return int4_linear(x, l.a, l.b, l.group, l.block, l.kind == kInt4GateUp ? kSilu : kGeluTanh, l.bf16_dot);
  }
  TORCH_CHECK(false, "unknown linear kind ", l.kind);
}

at::Tensor norm(const Norm& n, const at::Tensor& x) {
  return n.b.defined() ? at::layer_norm(x, {x.size(-1)}, n.w, n.b, n.eps) : rms_norm(x, n.w, n.eps);
}

// a non-gated MLP's activation (PlainAct), in place on the up projection's output
void plain_act(at::Tensor& u, int64_t act) {
  switch (act) {
    case kPlainGeluTanh: at::gelu_(u, "tanh"); return;
    case kPlainGelu: at::gelu_(u, "none"); return;
    case kPlainRelu: at::relu_(u); return;
    case kPlainSilu: at::silu_(u); return;
  }
  TORCH_CHECK(false, "unknown MLP activation ", act);
}

// a sequence's cached rows [0, end) of one layer's paged cache [blocks, KV, bs, D] as fp32 [1, KV, end, D]: a view
// of its block where they are in one (the static fp32 cache), else gathered through the block table (int8 rows
// widened and scaled)
at::Tensor seq_rows(const at::Tensor& cache, const c10::optional<at::Tensor>& scale, const at::Tensor& table,
                    int64_t slot, int64_t end) {
  const int64_t bs = cache.size(2), nb = (end + bs - 1) / bs;
  auto blocks = table.select(0, slot).narrow(0, 0, nb);
  if (nb == 1 && !scale) return cache.narrow(0, blocks.item<int64_t>(), 1).narrow(2, 0, end);
  auto rows = cache.index_select(0, blocks);  // [nb, KV, bs, D]
  if (scale) rows = rows.to(at::kFloat) * scale->index_select(0, blocks).unsqueeze(-1);
  return rows.transpose(0, 1).reshape({1, cache.size(1), nb * bs, cache.size(3)}).narrow(2, 0, end);
}

// One prefill chunk q [n, H, D] (positions start..) over its slot's keys [0, end) on aten's kernels, into dst (the
// rows of out as [1, H, n, D]): where prefill_attention does not take it (head_dim, or too many keys).
void chunk_on_aten(const at::Tensor& qp, const at::Tensor& kp, const at::Tensor& vp, at::Tensor dst, int64_t start,
                   int64_t window, double scale, bool gqa) {
  const int64_t n = qp.size(2), end = start + n;
  if (window > 0 && end > window) {  // keys before the first row's window are skipped, the rest masked
    const int64_t lo = first_key(start, window);
    auto i = at::arange(start, end, qp.options().dtype(at::kLong)).unsqueeze(1);
    auto j = at::arange(lo, end, qp.options().dtype(at::kLong)).unsqueeze(0);
    auto mask = j.le(i).logical_and(j.gt(i - window));  // HF's rule: i - window < j <= i
    dst.copy_(at::scaled_dot_product_attention(qp, kp.narrow(2, lo, end - lo), vp.narrow(2, lo, end - lo), mask,
                                               0.0, false, scale, gqa));
  } else if (start == 0) {
    dst.copy_(at::scaled_dot_product_attention(qp, kp, vp, c10::nullopt, 0.0, true, scale, gqa));
  } else {
    // A later chunk sees the cached prefix [0, start) unmasked and itself [start, end) causally. Two
    // flash calls merged by their logsumexp (as vLLM's merge_attn_states) instead of one call with an
    // [n, end] mask: that mask costs a bool tensor plus SDPA's float copy of it (2.5 MB per layer at
    // n=256, end=2048), the largest allocation of a chunk; the split is as fast and equal to 2e-7.
    auto A = at::_scaled_dot_product_flash_attention_for_cpu(qp, kp.narrow(2, 0, start), vp.narrow(2, 0, start),
                                                             0.0, false, c10::nullopt, scale);
    auto B = at::_scaled_dot_product_flash_attention_for_cpu(qp, kp.narrow(2, start, n), vp.narrow(2, start, n),
                                                             0.0, true, c10::nullopt, scale);
    // softmax over both parts = the parts' outputs weighted by sigmoid(lse_A - lse_B) and its complement
    auto w = at::sigmoid(std::get<1>(A) - std::get<1>(B)).unsqueeze(-1);
    at::lerp_out(dst, std::get<0>(B), std::get<0>(A), w);
  }
}

}  // namespace

LayerStack::LayerStack(std::vector<at::Tensor> norms, std::vector<at::Tensor> norm_bias, std::vector<double> eps,
                       std::vector<int64_t> kinds,
                       std::vector<at::Tensor> a, std::vector<at::Tensor> b, std::vector<at::Tensor> c,
                       std::vector<int64_t> groups, std::vector<int64_t> blocks, std::vector<at::Tensor> k_cache,
                       std::vector<at::Tensor> v_cache, std::vector<at::Tensor> k_scale,
                       std::vector<at::Tensor> v_scale, std::vector<int64_t> ropes, std::vector<int64_t> windows,
                       std::vector<int64_t> kv_groups, std::vector<int64_t> mlp_acts, std::vector<int64_t> parallel, int64_t heads,
                       int64_t kv_heads, int64_t head_dim, double scale, bool bf16_dot)
    : kc_(std::move(k_cache)), vc_(std::move(v_cache)), H_(heads), KV_(kv_heads), D_(head_dim), scale_(scale) {
  const size_t L = kc_.size();
  TORCH_CHECK(k_scale.size() == L && v_scale.size() == L, "LayerStack: a K and a V scale (maybe empty) per layer");
  for (size_t li = 0; li < L; ++li) {
    ks_.push_back(k_scale[li].numel() ? c10::optional<at::Tensor>(k_scale[li]) : c10::nullopt);
    vs_.push_back(v_scale[li].numel() ? c10::optional<at::Tensor>(v_scale[li]) : c10::nullopt);
  }
  TORCH_CHECK(vc_.size() == L && norms.size() == kNorms * L && norm_bias.size() == kNorms * L &&
                  eps.size() == kNorms * L && kinds.size() == 4 * L && a.size() == 4 * L && b.size() == 4 * L &&
                  c.size() == 4 * L && groups.size() == 4 * L && blocks.size() == 4 * L && ropes.size() == L &&
                  windows.size() == L && kv_groups.size() == L && mlp_acts.size() == L && parallel.size() == L,
              "LayerStack: 6 norms, 4 linears (qkv, o, gate_up, down), a RoPE table, a window, a KV group, an MLP "
              "activation and a residual kind per layer");
  auto none = [](const at::Tensor& t) { return t.numel() == 0 ? at::Tensor() : t; };
  for (size_t li = 0; li < L; ++li) {
    LayerSpec ls;
    for (size_t k = 0; k < kNorms; ++k)
      ls.norms[k] = Norm{none(norms[kNorms * li + k]), none(norm_bias[kNorms * li + k]), eps[kNorms * li + k]};
    ls.rope = ropes[li];
    ls.window = windows[li];
    ls.kv_group = kv_groups[li];
    ls.mlp_act = mlp_acts[li];
    ls.parallel = parallel[li] != 0;
    const auto& n = ls.norms;
    TORCH_CHECK(n[kNormIn].w.defined() && n[kNormPost].w.defined() &&
                    n[kNormPreFfw].w.defined() == n[kNormPostFfw].w.defined() &&
                    n[kNormQ].w.defined() == n[kNormK].w.defined() && ls.rope >= 0 && ls.window >= 0 &&
                    !n[kNormQ].b.defined() && !n[kNormK].b.defined() && !(ls.parallel && n[kNormPreFfw].w.defined()),
                "LayerStack: layer ", li, ": input and post-attention norms, both or none of the MLP's and of q/k's "
                "(RMSNorms), no sandwich norms with a parallel residual");
    layers_.push_back(std::move(ls));
  }
  for (size_t i = 0; i < 4 * L; ++i)
    linears_.push_back(LinearSpec{kinds[i], a[i], none(b[i]), none(c[i]), groups[i], blocks[i], bf16_dot});
}

// attention outputs [T, H, D] of layer li's queries q [T, H, D] (RoPE applied, K/V already in the cache)
at::Tensor LayerStack::attend(const at::Tensor& q, size_t li, const at::Tensor& table, const at::Tensor& dec_tok,
                              const at::Tensor& dec_slots, const at::Tensor& dec_len, bool all_dec,
                              const std::vector<int64_t>& prefill) const {
  const at::Tensor& kc = kc_[li];
  const at::Tensor& vc = vc_[li];
  const int64_t window = layers_[li].window, T = q.size(0);
  const auto& ks = ks_[li];
  const auto& vs = vs_[li];
  if (all_dec) return decode_attention(q, kc, vc, table, dec_slots, dec_len, scale_, window, ks, vs);
  auto out = at::empty({T, H_, D_}, q.options());
  if (dec_tok.numel() > 0)
    out.index_copy_(0, dec_tok, decode_attention(q.index_select(0, dec_tok), kc, vc, table, dec_slots, dec_len,
                                                 scale_, window, ks, vs));
  std::vector<int64_t> ours;  // the chunks prefill_attention takes, in one call (one parallel region)
  for (size_t i = 0; i < prefill.size(); i += 4) {
    const int64_t a = prefill[i], n = prefill[i + 1], slot = prefill[i + 2], start = prefill[i + 3];
    const int64_t end = start + n;
    if (prefill_attention_fits(D_, end - first_key(start, window))) {
      ours.insert(ours.end(), {a, n, slot, start});
      continue;
    }
    auto qp = q.narrow(0, a, n).transpose(0, 1).unsqueeze(0);  // [1, H, n, D]
    auto kp = seq_rows(kc, ks, table, slot, end);
    auto vp = seq_rows(vc, vs, table, slot, end);
    // the rows of out, as [1, H, n, D]
    chunk_on_aten(qp, kp, vp, out.narrow(0, a, n).transpose(0, 1).unsqueeze(0), start, window, scale_, KV_ != H_);
  }
  if (!ours.empty()) prefill_attention(q, kc, vc, table, out, ours, scale_, window, ks, vs);
  return out;
}

at::Tensor LayerStack::forward(at::Tensor h, const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                               const at::Tensor& tables, const at::Tensor& slots, const at::Tensor& positions,
                               const at::Tensor& dec_tok,
                               const at::Tensor& dec_slots, const at::Tensor& dec_len, bool all_dec,
                               const std::vector<int64_t>& prefill, const at::Tensor& keep) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "h must be contiguous [T, hidden]");
  TORCH_CHECK(prefill.size() % 4 == 0, "prefill: (offset, length, slot, start) per segment");
  TORCH_CHECK(cos.size() == sin.size(), "one (cos, sin) per RoPE table");
  const int64_t T = h.size(0), H = H_, KV = KV_, D = D_;
  const size_t L = layers_.size();
  for (size_t li = 0; li < L; ++li) {
    const LayerSpec& ls = layers_[li];
    const auto& nm = ls.norms;
    const LinearSpec* lin = &linears_[4 * li];
    TORCH_CHECK(ls.rope < static_cast<int64_t>(cos.size()), "no RoPE table ", ls.rope);
    TORCH_CHECK(tables.dim() == 3 && ls.kv_group < tables.size(0), "no block table for KV group ", ls.kv_group);
    const auto table = tables.select(0, ls.kv_group);  // [slots, blocks per sequence]
    auto x = norm(nm[kNormIn], h);
    auto heads = run_linear(lin[0], x).view({T, H + 2 * KV, D});
    rope_store(heads, cos[ls.rope], sin[ls.rope], H + KV, H, H + KV, kc_[li], vc_[li], table, slots, positions,
               opt(nm[kNormQ].w), nm[kNormQ].eps, opt(nm[kNormK].w), nm[kNormK].eps, ks_[li], vs_[li]);
    auto out = attend(heads.narrow(1, 0, H), li, table, dec_tok, dec_slots, dec_len, all_dec, prefill)
                   .view({T, H * D});
    if (li + 1 == L && keep.numel() > 0) {
      // the last layer: every token's K/V is in the cache now, and only the `keep` rows (the tokens whose
      // logits the step returns) go on through o_proj and the MLP (as llama.cpp's inp_out_ids); a prefill
      // chunk skips ~8% of its FLOPs here (the last layer's o_proj + MLP over all but its last token)
      out = out.index_select(0, keep);
      h = h.index_select(0, keep);
    }
    // down(act(gate) * up) or down(act(up)), plus `residual` where defined
    auto mlp = [&](const at::Tensor& in, const at::Tensor& residual) {
      auto u = run_linear(lin[2], in);
      if (ls.mlp_act != kGated) plain_act(u, ls.mlp_act);
      return run_linear(lin[3], u, residual);
    };
    if (nm[kNormPreFfw].w.defined()) {  // Gemma's sandwich: the attention's and the MLP's outputs normed too
      h = h + norm(nm[kNormPost], run_linear(lin[1], out));
      x = norm(nm[kNormPreFfw], h);
      h = h + norm(nm[kNormPostFfw], mlp(x, at::Tensor()));
    } else if (ls.parallel) {  // GPT-NeoX: the MLP reads the layer's input too
      h = run_linear(lin[1], out, mlp(norm(nm[kNormPost], h), h));  // (h + mlp(norm(h))) + o_proj(out)
    } else {
      h = run_linear(lin[1], out, h);  // h + o_proj(out)
      h = mlp(norm(nm[kNormPost], h), h);  // h + the MLP's output
    }
  }
  return h;
}

void bind_stack(pybind11::module_& m) {
  pybind11::class_<LayerStack>(m, "LayerStack", pybind11::module_local())
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<double>,
                          std::vector<int64_t>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                          std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>,
                          std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                          std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>,
                          std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, int64_t, int64_t,
                          int64_t, double, bool>())
      .def("forward", &LayerStack::forward,
           "the decoder layers over h [T, hidden] (fp32, CPU): the last layer's output rows `keep` "
           "([len(keep), hidden]), all T rows where keep is empty");
}

}  // namespace memfit
