#include "cc/common/bridge.h"
#include "cc/ops/rms_norm.h"

namespace nb = nanobind;

NB_MODULE(v4_rms_norm, m) {
  v4::init_module(m);
  m.def("v4_rms_norm", &v4_rms_norm, nb::arg("x"), nb::arg("weight"), nb::arg("eps"),
        nb::arg("zero_centered") = false, nb::call_guard<nb::gil_scoped_release>(),
        "RMSNorm over the last dim in fp32, output in x's dtype; zero_centered scales by 1 + w.");
}
