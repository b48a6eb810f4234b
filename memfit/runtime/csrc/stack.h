// LayerStack: SlotModel's decoder layers in one C++ call (stack.cpp).
#pragma once

#include <torch/extension.h>

#include <vector>

namespace memfit {

enum LinearKind : int64_t { kPanel = 0, kPanelSiluPairs = 1, kInt4 = 2, kInt4GateUp = 3 };

// one projection: panel (a = packed fp32 or int8, b = bias, c = int8's per-output scale) or int4 (a = packed,
// b = scale_zeros, c = bias); undefined tensors for what a projection does not have
struct LinearSpec {
  int64_t kind;
  at::Tensor a, b, c;
  int64_t group, block;
  bool bf16_dot;  // int4: x and weights rounded to bf16 for vdpbf16ps at prefill sizes (int4_linear)
};

class LayerStack {
 public:
  LayerStack(std::vector<at::Tensor> norm_in, std::vector<at::Tensor> norm_post, double eps,
             std::vector<int64_t> kinds, std::vector<at::Tensor> a, std::vector<at::Tensor> b,
             std::vector<at::Tensor> c, std::vector<int64_t> groups, std::vector<int64_t> blocks,
             std::vector<at::Tensor> k_cache, std::vector<at::Tensor> v_cache, int64_t heads, int64_t kv_heads,
             int64_t head_dim, double scale, bool bf16_dot);
  at::Tensor forward(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                     const at::Tensor& positions, const at::Tensor& dec_tok, const at::Tensor& dec_slots,
                     const at::Tensor& dec_len, bool all_dec, const std::vector<int64_t>& prefill,
                     const at::Tensor& keep);

 private:
  std::vector<at::Tensor> norm_in_, norm_post_;
  double eps_;
  std::vector<LinearSpec> linears_;  // 4 per layer: qkv, o, gate_up (or its silu pairs), down
  std::vector<at::Tensor> kc_, vc_;
  int64_t H_, KV_, D_;
  double scale_;
};

void bind_stack(pybind11::module_& m);

}  // namespace memfit
