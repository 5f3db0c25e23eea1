// A test-only module: the LoRA linear map that every layer op calls (v4::linear, cc/common/lora.h)
// and the routed experts' grouped product (v4::fp8_product with a dispatch, cc/common/experts.cc's
// call) alone, which no op exposes by themselves (parity/test_fp8_linear.py: their error bounds).
#include <ATen/ATen.h>

#include "cc/common/backend.h"
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
  m.def(
      "quantize_rows",
      [](const at::Tensor& x) {
        const auto kernel = v4::Backend<v4::Fp8QuantizeRows>::find(x.device().type());
        at::Tensor q, scale;
        TORCH_CHECK_VALUE(kernel && kernel(x, q, scale), "quantize_rows: x must be a bf16 [m, k] CUDA tensor, k a ",
                          "multiple of 128, in a build with the CUDA kernels; got ", x.scalar_type(), " ", x.sizes(),
                          " on ", x.device());
        return std::make_tuple(q, scale);
      },
      nb::arg("x"), nb::call_guard<nb::gil_scoped_release>(),
      "(q, scale): x's rows quantised to e4m3 per 128 columns as the FP8 tensor-core products take them "
      "(q [padded, k], scale [k / 128, padded], padded = m rounded up to 16).");
}
