// A test-only module exercising the bridge itself (py/tests/test_bridge.py).
#include <ATen/ATen.h>

#include <stdexcept>

#include "cc/common/bridge.h"
#include "cc/common/checks.h"

namespace nb = nanobind;

NB_MODULE(v4_bridge_test, m) {
  v4::init_module(m);
  m.def("identity", [](const at::Tensor& t) { return t; });
  m.def("maybe_add", [](const at::Tensor& x, std::optional<at::Tensor> y) {
    return y ? at::add(x, *y) : x;
  }, nb::arg("x"), nb::arg("y") = nb::none());
  m.def("undefined", [] { return at::Tensor(); });
  m.def("check_value", [](const at::Tensor& t) { v4::check_dim("check_value", "t", t, 2); });
  m.def("torch_check", [] { TORCH_CHECK(false, "torch_check: plain TORCH_CHECK failed"); });
  m.def("index_error", [] { TORCH_CHECK_INDEX(false, "index_error: out of range"); });
  m.def("std_error", [] { throw std::runtime_error("std_error: a std::runtime_error"); });
}
