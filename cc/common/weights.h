// The typed weights of the ops: each op's weights are a struct whose fields are written once, as
// X(type, name, default) lists, like the configs; the casters (bridge.h) read them by name from
// the Python dataclasses (v4train.reference.lora's bind), which fill them from a layer's tensors
// once, pairing each weight with its adapter there (v4train.reference.lora.adapter_names: the one
// place that names the adapters); py/tests/test_config_fields.py checks the two lists agree.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <type_traits>

#include "cc/common/config.h"

namespace v4 {

// One linear map's weight [out, in] (or a routed experts' [E, out, in]) as the ops see it: the
// weight, its FP8 block scales where it is float8 (weight_scale_inv; refused until the FP8 linear
// exists: the checkpoint loader dequantises), and its LoRA pair, A [r, in] and B [out, r] ([E, r,
// in] and [E, out, r] for experts), where it has an adapter.
#define V4_LINEAR_FIELDS(X)                                       \
  X(at::Tensor, weight, {})                                       \
  X(std::optional<at::Tensor>, weight_scale_inv, std::nullopt)    \
  X(std::optional<at::Tensor>, lora_A, std::nullopt)              \
  X(std::optional<at::Tensor>, lora_B, std::nullopt)

struct Linear {
  V4_LINEAR_FIELDS(V4_DECLARE_FIELD)
};

// ---- every tensor of a weights struct, by its path ("q_a_proj.weight"), for checks and the
// checkpoint's recomputation: visit_fields(weights, "", f) calls f(path, tensor) for each defined
// tensor, in the order the lists write them.
template <typename T>
struct is_optional : std::false_type {};
template <typename T>
struct is_optional<std::optional<T>> : std::true_type {};

template <typename T, typename F>
void visit_field(T& field, const std::string& path, F& f) {
  using U = std::remove_const_t<T>;
  if constexpr (std::is_same_v<U, at::Tensor>) {
    if (field.defined()) f(path, field);
  } else if constexpr (is_optional<U>::value) {
    if (field) visit_field(*field, path, f);
  } else {
    visit_fields(field, path + ".", f);
  }
}

#define V4_VISIT_FIELD(type, name, init) visit_field(s.name, path + #name, f);
// visit_fields for a struct of an X list (both constnesses).
#define V4_FIELD_VISITOR(Type, FIELDS)                                          \
  template <typename F>                                                         \
  void visit_fields(Type& s, const std::string& path, F& f) { FIELDS(V4_VISIT_FIELD) } \
  template <typename F>                                                         \
  void visit_fields(const Type& s, const std::string& path, F& f) { FIELDS(V4_VISIT_FIELD) }

V4_FIELD_VISITOR(Linear, V4_LINEAR_FIELDS)

// Every tensor of `weights` floating and on x's device: a tensor on another device (a CPU or meta
// one among CUDA ones) is refused by its path before any compute.
template <typename W>
void check_weights(const char* op, const W& weights, const at::Tensor& x) {
  auto check = [&](const std::string& path, const at::Tensor& w) {
    TORCH_CHECK_VALUE(w.is_floating_point(), op, ": weights.", path, " must be floating point, got ", w.scalar_type());
    TORCH_CHECK_VALUE(w.device() == x.device(), op, ": weights.", path, " is on ", w.device(), " but the input is on ",
                      x.device());
  };
  visit_fields(weights, "", check);
}

// The SwiGLU MLP's (GLM-5's dense layers and shared expert, Qwen3.5's): [I, H], [I, H], [H, I].
#define V4_MLP_WEIGHTS_FIELDS(X) \
  X(Linear, gate_proj, {})       \
  X(Linear, up_proj, {})         \
  X(Linear, down_proj, {})

struct MlpWeights {
  V4_MLP_WEIGHTS_FIELDS(V4_DECLARE_FIELD)
};
V4_FIELD_VISITOR(MlpWeights, V4_MLP_WEIGHTS_FIELDS)

// The routed experts, fused as transformers keeps them: gate_up_proj [E, 2I, H] (gate rows, then
// up), down_proj [E, H, I].
#define V4_EXPERTS_WEIGHTS_FIELDS(X) \
  X(Linear, gate_up_proj, {})        \
  X(Linear, down_proj, {})

struct ExpertsWeights {
  V4_EXPERTS_WEIGHTS_FIELDS(V4_DECLARE_FIELD)
};
V4_FIELD_VISITOR(ExpertsWeights, V4_EXPERTS_WEIGHTS_FIELDS)

}  // namespace v4
