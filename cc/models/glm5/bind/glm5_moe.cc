#include "cc/models/glm5/bind/config.h"
#include "cc/models/glm5/glm5_moe.h"

namespace nb = nanobind;

NB_MODULE(v4_glm5_moe, m) {
  v4::init_module(m);
  m.def("v4_glm5_moe", &v4_glm5_moe, nb::arg("x"), nb::arg("weights"), nb::arg("top_k"), nb::arg("n_group"),
        nb::arg("topk_group"), nb::arg("norm_topk_prob"), nb::arg("routed_scaling_factor"),
        nb::arg("lora_scaling") = 0.0, nb::arg("lora_dropout") = 0.0, nb::arg("routing") = nb::none(),
        nb::arg("expert_parallel").none() = nb::none(),
        nb::call_guard<nb::gil_scoped_release>(),
        "GLM-5 MoE: sigmoid group-limited router, grouped-GEMM experts, shared expert; returns (out, routing).");
}
