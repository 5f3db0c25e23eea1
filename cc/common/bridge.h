// The at::Tensor <-> Python bridge used by every op module (cc/bind/*.cc).
//
// The caster hands C++ the very at::Tensor the Python torch.Tensor wraps, and hands Python
// back the tensor C++ made, through torch's own THPVariable functions: no copy, and the
// autograd graph recorded by at:: calls is the one loss.backward() walks. (nb::ndarray /
// DLPack would create a fresh tensor with no autograd history.)
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <torch/csrc/autograd/python_variable.h>

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

}  // namespace nanobind::detail

namespace v4 {

// Call first in every NB_MODULE: maps c10 errors to the matching Python exception
// (TORCH_CHECK_VALUE -> ValueError, TORCH_CHECK_TYPE -> TypeError, TORCH_CHECK ->
// RuntimeError, ...) with the message but without the C++ backtrace.
void init_module(nanobind::module_& m);

}  // namespace v4
