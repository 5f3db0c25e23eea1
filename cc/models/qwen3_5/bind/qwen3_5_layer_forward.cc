#include "cc/models/qwen3_5/bind/config.h"
#include "cc/models/qwen3_5/qwen3_5_layer_forward.h"

namespace nb = nanobind;

NB_MODULE(v4_qwen3_5_layer_forward, m) {
  v4::init_module(m);
  m.def("v4_qwen3_5_layer_forward", &v4_qwen3_5_layer_forward, nb::arg("hidden"), nb::arg("weights"), nb::arg("cfg"),
        nb::arg("layer"), nb::arg("batch"), nb::arg("options"),
        nb::call_guard<nb::gil_scoped_release>(),
        "One Qwen3.5 decoder layer over packed tokens in one call; returns hidden.");
}
