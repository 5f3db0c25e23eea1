// A test-only module: the LoRA linear map that every layer op calls (v4::linear, cc/common/lora.h)
// and the routed experts' grouped product (v4::fp8_product with a dispatch, cc/common/experts.cc's
// call) alone, which no op exposes by themselves (parity/test_fp8_linear.py: their error bounds).
#include <ATen/ATen.h>

#include "cc/common/bridge.h"
#include "cc/common/experts.h"
#include "cc/common/lora.h"

namespace nb = nanobind;

NB_MODULE(v4_linear_test, m) {
  v4::init_module(m);
  m.def(
      "linear",
      [](const at::Tensor& x, const v4::Linear& w, double lora_scaling) {
        return v4::linear(x, w, v4::Lora{lora_scaling, 0.0}, "linear", "w");
      },
      nb::arg("x"), nb::arg("w"), nb::arg("lora_scaling") = 0.0, nb::call_guard<nb::gil_scoped_release>(),
      "x W^T (+ lora_scaling x A^T B^T) for w a v4train.reference.lora.Linear, FP8 or not.");
  m.def(
      "grouped",
      [](const at::Tensor& x, const v4::Linear& w, const at::Tensor& counts) {
        v4::Dispatch d;
        d.counts = counts;
        d.offsets = at::cumsum(counts, 0).to(at::kInt);
        return w.weight_scale_inv ? v4::fp8_product(x, w, &d, "grouped", "w") : v4::grouped_linear(x, w.weight, d);
      },
      nb::arg("x"), nb::arg("w"), nb::arg("counts"), nb::call_guard<nb::gil_scoped_release>(),
      "Each row of x times its expert's weight w [E, out, in] (counts [E] int64: rows an expert, in order).");
}
