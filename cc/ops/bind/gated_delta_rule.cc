#include "cc/common/bridge.h"
#include "cc/ops/gated_delta_rule.h"

namespace nb = nanobind;

NB_MODULE(v4_gated_delta_rule, m) {
  v4::init_module(m);
  m.def("v4_gated_delta_rule", &v4_gated_delta_rule, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"),
        nb::arg("beta"), nb::arg("cu_seqlens"), nb::call_guard<nb::gil_scoped_release>(),
        "The chunked gated delta rule over packed documents, the state reset at each one: o [T, Hv, Dv]");
}
