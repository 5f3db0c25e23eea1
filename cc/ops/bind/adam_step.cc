#include "cc/common/bridge.h"
#include "cc/ops/adam_step.h"

namespace nb = nanobind;

NB_MODULE(v4_adam_step, m) {
  v4::init_module(m);
  m.def("v4_adam_step", &v4_adam_step, nb::arg("params"), nb::arg("grads"), nb::arg("exp_avgs"),
        nb::arg("exp_avg_sqs"), nb::arg("step"), nb::arg("lr"), nb::arg("beta1"), nb::arg("beta2"),
        nb::arg("eps"), nb::arg("weight_decay"), nb::arg("master_params") = std::vector<at::Tensor>(),
        nb::call_guard<nb::gil_scoped_release>(),
        "AdamW over lists of tensors, in place, in fp32; with master_params the fp32 masters are updated and "
        "params receive their rounded values.");
}
