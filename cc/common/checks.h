// Input checks for op boundaries. Each failure names the op, the argument and what was
// expected, and raises ValueError in Python (TORCH_CHECK_VALUE -> c10::ValueError).
#pragma once

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

namespace v4 {

// A training activation or weight: float32, bfloat16 or float16; and float64 where an op also
// runs in float64 (the layer ops and their building blocks: their math is checked in float64).
inline void check_floating(const char* op, const char* name, const at::Tensor& t, bool float64 = false) {
  TORCH_CHECK_VALUE(t.defined(), op, ": ", name, " is undefined");
  const auto dtype = t.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf ||
                        (float64 && dtype == at::kDouble),
                    op, ": ", name, " must be float32, bfloat16", float64 ? ", float16 or float64" : " or float16",
                    ", got ", dtype);
}

// The dtype an op computes in: float32, or float64 for float64 input.
inline at::ScalarType compute_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

inline void check_dim(const char* op, const char* name, const at::Tensor& t, int64_t dim) {
  TORCH_CHECK_VALUE(t.dim() == dim, op, ": ", name, " must have ", dim, " dimension(s), got shape ",
                    t.sizes());
}

inline void check_min_dim(const char* op, const char* name, const at::Tensor& t, int64_t dim) {
  TORCH_CHECK_VALUE(t.dim() >= dim, op, ": ", name, " must have at least ", dim,
                    " dimension(s), got shape ", t.sizes());
}

inline void check_size(const char* op, const char* name, const at::Tensor& t, int64_t dim,
                       int64_t expected, const char* what) {
  TORCH_CHECK_VALUE(t.size(dim) == expected, op, ": ", name, ".size(", dim, ") must be ", what,
                    " = ", expected, ", got shape ", t.sizes());
}

inline void check_same_device(const char* op, const char* name, const at::Tensor& t,
                              const char* ref_name, const at::Tensor& ref) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ",
                    ref_name, " is on ", ref.device());
}

// A tensor an op updates in place: no two of its elements may share memory (an expanded view).
inline void check_writable(const char* op, const char* name, const at::Tensor& t, size_t i) {
  TORCH_CHECK_VALUE(at::has_internal_overlap(t) != at::MemOverlap::Yes, op, ": ", name, "[", i,
                    "] has elements that share memory (an expanded or overlapping view, strides ", t.strides(),
                    "): it cannot be updated in place");
}

// A small integer tensor as the list a user would write ("[0, 5, 8]"; at most 16 values, then
// "..."): streaming a tensor into a message prints its repr over several lines ("got  0").
inline std::string as_list(const at::Tensor& t) {
  const at::Tensor flat = t.to(at::kCPU).reshape({-1}).to(at::kLong);
  std::string out = "[";
  const int64_t n = flat.numel(), shown = std::min<int64_t>(n, 16);
  for (int64_t i = 0; i < shown; ++i) out += (i ? ", " : "") + std::to_string(flat[i].item<int64_t>());
  return out + (n > shown ? ", ...]" : "]");
}

// The documents of a packed batch: cu_seqlens int64 [N + 1] rising from 0 to T (on any device),
// as (start, end) pairs.
inline std::vector<std::pair<int64_t, int64_t>> documents(const char* op, const at::Tensor& cu_seqlens, int64_t T) {
  TORCH_CHECK_VALUE(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 1, op,
                    ": cu_seqlens must be int64 [documents + 1], got ", cu_seqlens.scalar_type(), " ",
                    cu_seqlens.sizes());
  const at::Tensor cu = cu_seqlens.to(at::kCPU).contiguous();
  const int64_t* p = cu.data_ptr<int64_t>();
  std::vector<std::pair<int64_t, int64_t>> docs;
  for (int64_t i = 0; i + 1 < cu.numel(); ++i) {
    TORCH_CHECK_VALUE(p[i] == (i == 0 ? 0 : docs.back().second) && p[i + 1] >= p[i], op,
                      ": cu_seqlens must rise from 0 to T=", T, ", got ", as_list(cu));
    docs.emplace_back(p[i], p[i + 1]);
  }
  TORCH_CHECK_VALUE(p[0] == 0 && p[cu.numel() - 1] == T, op, ": cu_seqlens must end at T=", T, ", got ", as_list(cu));
  return docs;
}

}  // namespace v4
