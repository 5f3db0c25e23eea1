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
#include "cc/common/layer_call.h"
#include "cc/common/weights.h"

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

// The structs written as X(type, name, default) lists (the model configs of config.h, Batch and
// LayerOptions of layer_call.h, the ops' weights of weights.h and the ops' headers), read field
// by field from the Python objects (v4train's dataclasses, or any object with those attributes).
// A missing or mistyped field makes the call fail with nanobind's TypeError listing the expected
// signature.
template <typename T>
bool read_attr(handle src, const char* name, T& out) {
  object value = getattr(src, name, none());
  if (value.is_none()) return false;
  return try_cast<T>(value, out);
}

// An optional field (a number, a tensor, a part of a layer's weights): None leaves it unset.
template <typename T>
bool read_attr(handle src, const char* name, std::optional<T>& out) {
  object value = getattr(src, name, none());
  if (value.is_none()) return true;
  T v{};  // written by try_cast on success; the initialiser quiets -Wmaybe-uninitialized
  if (!try_cast<T>(value, v)) return false;
  out = std::move(v);
  return true;
}

#define V4_READ_FIELD(type, name, init) &&read_attr(src, #name, value.name)

// The caster of such a struct: every field of its list, read by its name.
#define V4_FIELDS_CASTER(Type, FIELDS)                                                      \
  template <>                                                                               \
  struct type_caster<v4::Type> {                                                            \
    NB_TYPE_CASTER(v4::Type, const_name(#Type))                                             \
    bool from_python(handle src, uint8_t, cleanup_list*) noexcept { return true FIELDS(V4_READ_FIELD); } \
    static handle from_cpp(const v4::Type&, rv_policy, cleanup_list*) noexcept { return handle(); } \
  };

V4_FIELDS_CASTER(Rope, V4_ROPE_FIELDS)
V4_FIELDS_CASTER(Batch, V4_BATCH_FIELDS)
V4_FIELDS_CASTER(ExpertParallel, V4_EXPERT_PARALLEL_FIELDS)
V4_FIELDS_CASTER(LayerOptions, V4_LAYER_OPTIONS_FIELDS)
V4_FIELDS_CASTER(Linear, V4_LINEAR_FIELDS)
V4_FIELDS_CASTER(MlpWeights, V4_MLP_WEIGHTS_FIELDS)
V4_FIELDS_CASTER(ExpertsWeights, V4_EXPERTS_WEIGHTS_FIELDS)

}  // namespace nanobind::detail

namespace v4 {

// Call first in every NB_MODULE: maps c10 errors to the matching Python exception
// (TORCH_CHECK_VALUE -> ValueError, TORCH_CHECK_TYPE -> TypeError, TORCH_CHECK ->
// RuntimeError, ...) with the message but without the C++ backtrace.
void init_module(nanobind::module_& m);

}  // namespace v4
