#include "cc/models/qwen3_5/bind/config.h"
#include "cc/models/qwen3_5/qwen3_5_moe.h"

namespace nb = nanobind;

NB_MODULE(v4_qwen3_5_moe, m) {
  v4::init_module(m);
  m.def("v4_qwen3_5_moe", &v4_qwen3_5_moe, nb::arg("x"), nb::arg("weights"), nb::arg("top_k"),
        nb::arg("norm_topk_prob") = true, nb::arg("lora_scaling") = 0.0, nb::arg("lora_dropout") = 0.0,
        nb::arg("routing") = nb::none(),
        nb::arg("expert_parallel").none() = nb::none(), nb::call_guard<nb::gil_scoped_release>(),
        "Qwen3.5-MoE: softmax router, grouped-GEMM experts, sigmoid-gated shared expert; returns (out, routing).");
}
