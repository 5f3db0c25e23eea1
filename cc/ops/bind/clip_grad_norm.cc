#include "cc/common/bridge.h"
#include "cc/ops/clip_grad_norm.h"

namespace nb = nanobind;

NB_MODULE(v4_clip_grad_norm, m) {
  v4::init_module(m);
  m.def("v4_clip_grad_norm", &v4_clip_grad_norm, nb::arg("grads"), nb::arg("max_norm"),
        nb::arg("group").none() = nb::none(), nb::arg("copies").none() = nb::none(),
        nb::call_guard<nb::gil_scoped_release>(),
        "Global L2 norm of the gradients (fp32; over the ranks of `group` for sharded gradients); scales them "
        "in place when max_norm > 0.");
}
