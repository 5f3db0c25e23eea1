#include "cc/common/bridge.h"
#include "cc/ops/mlp.h"

namespace nb = nanobind;

NB_MODULE(v4_mlp, m) {
  v4::init_module(m);
  m.def("v4_mlp", &v4_mlp, nb::arg("x"), nb::arg("weights"), nb::arg("lora_scaling") = 0.0,
        nb::arg("lora_dropout") = 0.0, nb::call_guard<nb::gil_scoped_release>(),
        "SwiGLU MLP down(silu(gate(x)) * up(x)) with weights.{gate,up,down}_proj (MlpWeights), LoRA inside.");
}
