#include "cc/models/qwen3_5/bind/config.h"
#include "cc/models/qwen3_5/gated_attention.h"

namespace nb = nanobind;

NB_MODULE(v4_gated_attention, m) {
  v4::init_module(m);
  m.def("v4_gated_attention", &v4_gated_attention, nb::arg("h"), nb::arg("weights"), nb::arg("num_heads"),
        nb::arg("num_kv_heads"), nb::arg("head_dim"), nb::arg("rope"), nb::arg("eps"), nb::arg("positions"),
        nb::arg("cu_seqlens"), nb::arg("lora_scaling") = 0.0, nb::arg("lora_dropout") = 0.0,
        nb::call_guard<nb::gil_scoped_release>(),
        "Qwen3.5's gated full attention over packed documents in one call: [T, H] -> [T, H].");
}
