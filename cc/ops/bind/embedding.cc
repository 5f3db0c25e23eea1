#include "cc/common/bridge.h"
#include "cc/ops/embedding.h"

namespace nb = nanobind;

NB_MODULE(v4_embedding, m) {
  v4::init_module(m);
  m.def("v4_embedding", &v4_embedding, nb::arg("input_ids"), nb::arg("weight"),
        nb::call_guard<nb::gil_scoped_release>(), "weight[input_ids] (the token embedding).");
}
