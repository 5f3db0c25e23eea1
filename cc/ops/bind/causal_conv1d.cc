#include "cc/common/bridge.h"
#include "cc/ops/causal_conv1d.h"

namespace nb = nanobind;

NB_MODULE(v4_causal_conv1d, m) {
  v4::init_module(m);
  m.def("v4_causal_conv1d", &v4_causal_conv1d, nb::arg("x"), nb::arg("weight"), nb::arg("cu_seqlens"),
        nb::call_guard<nb::gil_scoped_release>(),
        "silu(depthwise causal conv1d(x, weight)) over packed documents, no state across a boundary");
}
