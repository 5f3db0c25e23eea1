// The at::Tensor <-> Python bridge used by every op module (cc/bind/*.cc).
//
// The caster hands C++ the very at::Tensor the Python torch.Tensor wraps, and hands Python
// back the tensor C++ made, through torch's own THPVariable functions: no copy, and the
// autograd graph recorded by at:: calls is the one loss.backward() walks. (nb::ndarray /
// DLPack would create a fresh tensor with no autograd history.)
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>
#include <torch/csrc/autograd/python_variable.h>

#include "cc/common/config.h"

namespace nanobind::detail {

template <>
struct type_caster<at::Tensor> {
  NB_TYPE_CASTER(at::Tensor, const_name("torch.Tensor"))

  bool from_python(handle src, uint8_t, cleanup_list*) noexcept {
    if (!THPVariable_Check(src.ptr())) return false;
    value = THPVariable_Unpack(src.ptr());
    return true;
  }

  static handle from_cpp(const at::Tensor& tensor, rv_policy, cleanup_list*) noexcept {
    if (!tensor.defined()) return none().release();
    try {
      return THPVariable_Wrap(tensor);
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
      return handle();
    }
  }
};

// The model configs (v4train.models.config dataclasses, or any object with those attributes),
// read field by field into the C++ structs of config.h. A missing or mistyped field makes the
// call fail with nanobind's TypeError listing the expected signature.
template <typename T>
bool read_attr(handle src, const char* name, T& out) {
  object value = getattr(src, name, none());
  if (value.is_none()) return false;
  return try_cast<T>(value, out);
}

template <>
struct type_caster<v4::Rope> {
  NB_TYPE_CASTER(v4::Rope, const_name("Rope"))

  bool from_python(handle src, uint8_t, cleanup_list*) noexcept {
    object factor = getattr(src, "attention_factor", none());
    if (!factor.is_none()) {
      double f = 0;  // written by try_cast on success; the initialiser quiets -Wmaybe-uninitialized
      if (!try_cast<double>(factor, f)) return false;
      value.attention_factor = f;
    }
    return read_attr(src, "theta", value.theta) && read_attr(src, "dim", value.dim) &&
           read_attr(src, "type", value.type) && read_attr(src, "factor", value.factor) &&
           read_attr(src, "original_max_position_embeddings", value.original_max_position_embeddings) &&
           read_attr(src, "beta_fast", value.beta_fast) && read_attr(src, "beta_slow", value.beta_slow) &&
           read_attr(src, "mscale", value.mscale) && read_attr(src, "mscale_all_dim", value.mscale_all_dim) &&
           read_attr(src, "truncate", value.truncate);
  }

  static handle from_cpp(const v4::Rope&, rv_policy, cleanup_list*) noexcept { return handle(); }
};

template <>
struct type_caster<v4::Glm5Config> {
  NB_TYPE_CASTER(v4::Glm5Config, const_name("Glm5Config"))

  bool from_python(handle src, uint8_t, cleanup_list*) noexcept {
    std::vector<std::string> mlp, indexer;
    return read_attr(src, "hidden_size", value.hidden_size) &&
           read_attr(src, "num_attention_heads", value.num_attention_heads) &&
           read_attr(src, "q_lora_rank", value.q_lora_rank) && read_attr(src, "kv_lora_rank", value.kv_lora_rank) &&
           read_attr(src, "qk_nope_head_dim", value.qk_nope_head_dim) &&
           read_attr(src, "qk_rope_head_dim", value.qk_rope_head_dim) &&
           read_attr(src, "v_head_dim", value.v_head_dim) && read_attr(src, "index_topk", value.index_topk) &&
           read_attr(src, "index_head_dim", value.index_head_dim) &&
           read_attr(src, "index_n_heads", value.index_n_heads) &&
           read_attr(src, "num_experts_per_tok", value.num_experts_per_tok) &&
           read_attr(src, "n_group", value.n_group) && read_attr(src, "topk_group", value.topk_group) &&
           read_attr(src, "norm_topk_prob", value.norm_topk_prob) &&
           read_attr(src, "routed_scaling_factor", value.routed_scaling_factor) &&
           read_attr(src, "rms_norm_eps", value.rms_norm_eps) &&
           read_attr(src, "mlp_layer_types", value.mlp_layer_types) &&
           read_attr(src, "indexer_types", value.indexer_types) && read_attr(src, "rope", value.rope);
  }

  static handle from_cpp(const v4::Glm5Config&, rv_policy, cleanup_list*) noexcept { return handle(); }
};

template <>
struct type_caster<v4::Qwen35Config> {
  NB_TYPE_CASTER(v4::Qwen35Config, const_name("Qwen35Config"))

  bool from_python(handle src, uint8_t, cleanup_list*) noexcept {
    return read_attr(src, "num_attention_heads", value.num_attention_heads) &&
           read_attr(src, "num_key_value_heads", value.num_key_value_heads) &&
           read_attr(src, "head_dim", value.head_dim) &&
           read_attr(src, "linear_num_key_heads", value.linear_num_key_heads) &&
           read_attr(src, "linear_num_value_heads", value.linear_num_value_heads) &&
           read_attr(src, "linear_key_head_dim", value.linear_key_head_dim) &&
           read_attr(src, "linear_value_head_dim", value.linear_value_head_dim) &&
           read_attr(src, "num_experts_per_tok", value.num_experts_per_tok) && read_attr(src, "is_moe", value.is_moe) &&
           read_attr(src, "rms_norm_eps", value.rms_norm_eps) && read_attr(src, "layer_types", value.layer_types) &&
           read_attr(src, "rope", value.rope);
  }

  static handle from_cpp(const v4::Qwen35Config&, rv_policy, cleanup_list*) noexcept { return handle(); }
};

}  // namespace nanobind::detail

namespace v4 {

// Call first in every NB_MODULE: maps c10 errors to the matching Python exception
// (TORCH_CHECK_VALUE -> ValueError, TORCH_CHECK_TYPE -> TypeError, TORCH_CHECK ->
// RuntimeError, ...) with the message but without the C++ backtrace.
void init_module(nanobind::module_& m);

}  // namespace v4
