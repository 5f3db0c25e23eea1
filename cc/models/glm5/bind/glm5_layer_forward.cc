#include "cc/models/glm5/bind/config.h"
#include "cc/models/glm5/glm5_layer_forward.h"

namespace nb = nanobind;

NB_MODULE(v4_glm5_layer_forward, m) {
  v4::init_module(m);
  m.def("v4_glm5_layer_forward", &v4_glm5_layer_forward, nb::arg("hidden"), nb::arg("weights"), nb::arg("cfg"),
        nb::arg("layer"), nb::arg("batch"), nb::arg("options"), nb::arg("carry") = nb::none(),
        nb::call_guard<nb::gil_scoped_release>(),
        "One GLM-5 decoder layer (attention + MLP/MoE) in one call; returns (hidden, DSA selection).");
}
