// A test-only module: the LoRA linear map that every layer op calls (v4::linear, cc/common/lora.h)
// alone, which no op exposes by itself (parity/test_fp8_linear.py: the FP8 path's error bound).
#include "cc/common/bridge.h"
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
}
