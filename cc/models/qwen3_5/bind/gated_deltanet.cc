#include "cc/models/qwen3_5/bind/config.h"
#include "cc/models/qwen3_5/gated_deltanet.h"

namespace nb = nanobind;

NB_MODULE(v4_gated_deltanet, m) {
  v4::init_module(m);
  m.def("v4_gated_deltanet", &v4_gated_deltanet, nb::arg("h"), nb::arg("weights"), nb::arg("num_key_heads"),
        nb::arg("num_value_heads"), nb::arg("key_head_dim"), nb::arg("value_head_dim"), nb::arg("eps"),
        nb::arg("cu_seqlens"), nb::arg("lora_scaling") = 0.0, nb::arg("lora_dropout") = 0.0,
        nb::call_guard<nb::gil_scoped_release>(),
        "Qwen3.5's Gated DeltaNet block over packed documents in one call: [T, H] -> [T, H].");
}
