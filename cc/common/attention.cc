#include "cc/common/attention.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>

namespace v4 {
namespace {

// The view itself where its first element and every row (each stride but the last's) are 16-byte
// aligned, else a fresh copy: the flash, cuDNN and memory-efficient attention kernels read 16
// bytes at a time and check only the last dimension (GLM-5's v is a slice of kv_b's output, at an
// odd offset or head stride when the head dims are odd; seen faulting in float32). A copy, not
// contiguous(): a document's rows of a contiguous tensor are contiguous already, and start where
// the document does (one head of 4 bf16 values from an odd token: 8 bytes off, seen faulting in
// the flash kernel under compute-sanitizer); a new allocation starts aligned.
at::Tensor aligned(const at::Tensor& t) {
  bool ok = reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0 && t.stride(-1) == 1;
  for (int64_t i = 0; ok && i + 1 < t.dim(); ++i) ok = (t.stride(i) * t.element_size()) % 16 == 0 || t.size(i) == 1;
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

}  // namespace

std::vector<at::Tensor> per_document(const at::Tensor& x, const std::vector<std::pair<int64_t, int64_t>>& docs) {
  std::vector<int64_t> sizes;
  for (const auto& [start, end] : docs) sizes.push_back(end - start);
  return x.split_with_sizes(sizes, 0);
}

at::Tensor sdpa(const at::Tensor& q, const at::Tensor& k_in, const at::Tensor& v_in, double scale, bool causal,
                const std::optional<at::Tensor>& mask) {
  const int64_t rep = q.size(1) / k_in.size(1);
  const at::Tensor k = rep > 1 ? k_in.repeat_interleave(rep, 1) : k_in, v = rep > 1 ? v_in.repeat_interleave(rep, 1) : v_in;
  const auto heads_first = [](const at::Tensor& t) { return aligned(t.transpose(0, 1).unsqueeze(0)); };
  if (q.scalar_type() == at::kDouble || q.device().is_cpu()) {
    const auto compute = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    at::Tensor allowed = causal ? at::ones({q.size(0), k.size(0)}, q.options().dtype(at::kBool)).tril()
                                : mask.value_or(at::ones({q.size(0), k.size(0)}, q.options().dtype(at::kBool)));
    const at::Tensor s =
        at::matmul(heads_first(q).to(compute), heads_first(k).to(compute).transpose(-1, -2)) * scale;
    const at::Tensor p = at::softmax(s.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity()), -1);
    return at::matmul(p, heads_first(v).to(compute)).squeeze(0).transpose(0, 1).to(q.scalar_type());
  }
  const at::Tensor o = at::scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), mask, 0.0,
                                                        causal, scale);
  return o.squeeze(0).transpose(0, 1);
}

}  // namespace v4
