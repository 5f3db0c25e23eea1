#include "cc/common/bridge.h"
#include "cc/ops/cross_entropy_loss.h"

namespace nb = nanobind;

NB_MODULE(v4_cross_entropy_loss, m) {
  v4::init_module(m);
  m.def("v4_cross_entropy_loss", &v4_cross_entropy_loss, nb::arg("hidden"), nb::arg("weight"), nb::arg("targets"),
        nb::arg("normalizer") = 1.0, nb::arg("chunk_tokens") = 4096, nb::call_guard<nb::gil_scoped_release>(),
        "LM head + next-token cross-entropy, chunked: sum of token losses / normalizer (fp32).");
}
