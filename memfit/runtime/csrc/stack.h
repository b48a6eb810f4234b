// LayerStack: SlotModel's decoder layers in one C++ call (stack.cpp).
#pragma once

#include <torch/extension.h>

#include <array>
#include <vector>

namespace memfit {

// the gate/up kinds compute act(gate) * up in their epilogue (silu, or gelu_tanh for the *Gelu ones)
enum LinearKind : int64_t {
  kPanel = 0,
  kPanelSiluPairs = 1,
  kInt4 = 2,
  kInt4GateUp = 3,
  kPanelGeluPairs = 4,
  kInt4GateUpGelu = 5
};

// one projection: panel (a = packed fp32 or int8, b = bias, c = int8's per-output scale) or int4 (a = packed,
// b = scale_zeros, c = bias); undefined tensors for what a projection does not have
struct LinearSpec {
  int64_t kind;
  at::Tensor a, b, c;
  int64_t group, block;
  bool bf16_dot;  // int4 and int8: x and weights rounded to bf16 for vdpbf16ps at prefill sizes
};

// a layer's norms, by slot: the input norm; after attention (Llama: the MLP's input norm; Gemma: the norm of
// the attention output, and then kPreFfw / kPostFfw around the MLP: "sandwich" norms); per-head q and k norms
// (qwen3, Gemma 3). An undefined weight: the layer has no such norm. RMSNorms, or LayerNorms (GPT-2, GPT-NeoX:
// those with a bias) in the first four slots.
enum NormSlot { kNormIn = 0, kNormPost = 1, kNormPreFfw = 2, kNormPostFfw = 3, kNormQ = 4, kNormK = 5, kNorms = 6 };

struct Norm {
  at::Tensor w;  // the weight as the norm multiplies by it (Gemma's 1 + w folded in)
  at::Tensor b;  // a LayerNorm's bias; undefined: an RMSNorm
  double eps;
};

// a non-gated MLP's activation between its up and down projections (GPT-2's gelu_new is kPlainGeluTanh, GPT-NeoX's
// kPlainGelu); kGated: the gate/up projection computes act(gate) * up itself (LinearKind's pair kinds)
enum PlainAct : int64_t { kGated = 0, kPlainGeluTanh = 1, kPlainGelu = 2, kPlainRelu = 3, kPlainSilu = 4 };

struct LayerSpec {
  std::array<Norm, kNorms> norms;
  int64_t rope;    // which of forward's (cos, sin) tables the layer's RoPE uses
  int64_t window;  // sliding window (0: none): a query at position p sees keys p - window < j <= p
  int64_t kv_group;  // which of forward's block tables (one per KV group, memfit/runtime/kv_groups.py) it reads
  int64_t mlp_act;  // PlainAct
  bool parallel;    // GPT-NeoX: h + attn(norm_in(h)) + mlp(norm_post(h)), both reading the layer's input
};

class LayerStack {
 public:
  // per layer: 6 norms (NormSlot order; empty tensors where absent), their biases (empty: an RMSNorm) and eps,
  // 4 linears (qkv, o, gate_up or the plain MLP's up, down), the paged caches (common.h: KvPages; the block tables
  // come with each forward) and their scales (int8 caches; empty tensors for fp32 ones), the RoPE table index,
  // the sliding window, the KV group (its block table), the MLP's PlainAct and whether the residual is parallel
  LayerStack(std::vector<at::Tensor> norms, std::vector<at::Tensor> norm_bias, std::vector<double> eps,
             std::vector<int64_t> kinds,
             std::vector<at::Tensor> a, std::vector<at::Tensor> b, std::vector<at::Tensor> c,
             std::vector<int64_t> groups, std::vector<int64_t> blocks, std::vector<at::Tensor> k_cache,
             std::vector<at::Tensor> v_cache, std::vector<at::Tensor> k_scale, std::vector<at::Tensor> v_scale,
             std::vector<int64_t> ropes, std::vector<int64_t> windows, std::vector<int64_t> kv_groups,
             std::vector<int64_t> mlp_acts,
             std::vector<int64_t> parallel, int64_t heads, int64_t kv_heads, int64_t head_dim, double scale,
             bool bf16_dot);
  at::Tensor forward(at::Tensor h, const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                     const at::Tensor& tables, const at::Tensor& slots, const at::Tensor& positions, const at::Tensor& dec_tok,
                     const at::Tensor& dec_slots, const at::Tensor& dec_len, bool all_dec,
                     const std::vector<int64_t>& prefill, const at::Tensor& keep);

 private:
  at::Tensor attend(const at::Tensor& q, size_t li, const at::Tensor& table, const at::Tensor& dec_tok, const at::Tensor& dec_slots,
                    const at::Tensor& dec_len, bool all_dec, const std::vector<int64_t>& prefill) const;

  std::vector<LayerSpec> layers_;
  std::vector<LinearSpec> linears_;  // 4 per layer: qkv, o, gate_up (act(gate) * up pairs) or up, down
  std::vector<at::Tensor> kc_, vc_;
  std::vector<c10::optional<at::Tensor>> ks_, vs_;  // int8 caches' scales, nullopt for fp32
  int64_t H_, KV_, D_;
  double scale_;
};

void bind_stack(pybind11::module_& m);

}  // namespace memfit
