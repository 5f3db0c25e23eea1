#include "cc/common/bridge.h"
#include "cc/ops/qwen_moe.h"

namespace nb = nanobind;

NB_MODULE(v4_qwen_moe, m) {
  v4::init_module(m);
  m.def("v4_qwen_moe", &v4_qwen_moe, nb::arg("x"), nb::arg("weights"), nb::arg("prefix"), nb::arg("top_k"),
        nb::arg("norm_topk_prob") = true, nb::arg("lora_scaling") = 0.0, nb::arg("lora_dropout") = 0.0,
        nb::arg("routing") = nb::none(), nb::call_guard<nb::gil_scoped_release>(),
        "Qwen3.5-MoE: softmax router, grouped-GEMM experts, sigmoid-gated shared expert; returns (out, routing).");
}
