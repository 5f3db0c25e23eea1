#include "cc/common/bridge.h"
#include "cc/ops/adam_step.h"

namespace nb = nanobind;

NB_MODULE(v4_adam_step, m) {
  v4::init_module(m);
  m.def("v4_adam_step", &v4_adam_step, nb::arg("params"), nb::arg("grads"), nb::arg("exp_avgs"),
        nb::arg("exp_avg_sqs"), nb::arg("step"), nb::arg("lr"), nb::arg("beta1"), nb::arg("beta2"),
        nb::arg("eps"), nb::arg("weight_decay"), nb::call_guard<nb::gil_scoped_release>(),
        "AdamW over lists of tensors, in place; fp32 moments, the update written in each param's dtype.");
}
