#include "cc/models/qwen3_5/gated_attention.h"

#include <ATen/ATen.h>

#include <cmath>
#include <vector>

#include "cc/common/attention.h"
#include "cc/common/checks.h"
#include "cc/common/rope.h"
#include "cc/ops/rms_norm.h"

at::Tensor v4_gated_attention(const at::Tensor& h, const v4::GatedAttentionWeights& weights, int64_t num_heads, int64_t num_kv_heads,
                              int64_t head_dim, const v4::Rope& rope, double eps, const at::Tensor& positions,
                              const at::Tensor& cu_seqlens, double lora_scaling, double lora_dropout) {
  constexpr const char* op = "v4_gated_attention";
  v4::check_floating(op, "h", h, /*float64=*/true);
  v4::check_dim(op, "h", h, 2);
  v4::check_weights(op, weights, h);
  const int64_t T = h.size(0), nh = num_heads, nkv = num_kv_heads, hd = head_dim;
  TORCH_CHECK_VALUE(nh >= 1 && nkv >= 1 && nh % nkv == 0 && hd >= 1, op, ": ", nh, " heads over ", nkv,
                    " key/value heads of dim ", hd, " do not fit: heads must be a multiple of key/value heads");
  TORCH_CHECK_VALUE(rope.dim >= 0 && rope.dim <= hd && rope.dim % 2 == 0, op, ": the rotary dims (", rope.dim,
                    ") must be even and at most head_dim=", hd);
  TORCH_CHECK_VALUE(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == T, op,
                    ": positions must be int64 [", T, "], got ", positions.scalar_type(), " ", positions.sizes());
  v4::check_same_device(op, "positions", positions, "h", h);
  const auto docs = v4::documents(op, cu_seqlens, T);
  const at::Tensor& q_w = weights.q_proj.weight;
  TORCH_CHECK_VALUE(q_w.dim() == 2 && q_w.size(0) == nh * 2 * hd && q_w.size(1) == h.size(1), op,
                    ": q_proj.weight has shape ", q_w.sizes(), ", expected [", nh * 2 * hd, ", ", h.size(1),
                    "] (query and gate per head)");
  const v4::Lora lora{lora_scaling, lora_dropout};

  const at::Tensor q_gate = v4::linear(h, weights.q_proj, lora, op, "q_proj").view({T, nh, 2 * hd});
  const at::Tensor gate = q_gate.slice(-1, hd);
  at::Tensor q = v4_rms_norm(q_gate.slice(-1, 0, hd), weights.q_norm, eps, true);
  at::Tensor k = v4_rms_norm(v4::linear(h, weights.k_proj, lora, op, "k_proj").view({T, nkv, hd}),
                             weights.k_norm, eps, true);
  const at::Tensor v = v4::linear(h, weights.v_proj, lora, op, "v_proj").view({T, nkv, hd});
  const auto [cos, sin] = v4::rope_cos_sin(rope, positions, h.scalar_type());
  q = v4::rope_half(q, cos, sin);
  k = v4::rope_half(k, cos, sin);
  std::vector<at::Tensor> outs;
  const auto qs = v4::per_document(q, docs), ks = v4::per_document(k, docs), vs = v4::per_document(v, docs);
  for (size_t i = 0; i < docs.size(); ++i) {
    if (docs[i].second > docs[i].first) {
      outs.push_back(v4::sdpa(qs[i], ks[i], vs[i], std::pow(hd, -0.5), /*causal=*/true));
    }
  }
  const at::Tensor attn = outs.empty() ? at::zeros({0, nh, hd}, h.options()) : at::cat(outs, 0);
  return v4::linear(attn.reshape({T, nh * hd}) * at::sigmoid(gate.reshape({T, nh * hd})), weights.o_proj, lora, op,
                    "o_proj");
}
