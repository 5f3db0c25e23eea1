#include "cc/models/glm5/bind/config.h"
#include "cc/models/glm5/mla_dsa_attention.h"

namespace nb = nanobind;

NB_MODULE(v4_mla_dsa_attention, m) {
  v4::init_module(m);
  m.def("v4_mla_dsa_attention", &v4_mla_dsa_attention, nb::arg("h"), nb::arg("weights"), nb::arg("cfg"),
        nb::arg("layer"), nb::arg("positions"), nb::arg("cu_seqlens"), nb::arg("carry") = nb::none(),
        nb::arg("lora_scaling") = 0.0, nb::arg("lora_dropout") = 0.0, nb::arg("masked_max_len") = 8192,
        nb::call_guard<nb::gil_scoped_release>(),
        "GLM-5 MLA attention over the DSA-selected keys of each packed document; returns (out, selection).");
  m.def("set_block_bytes", &v4::set_block_bytes, nb::arg("bytes"),
        "For tests: the bytes of scores a block of queries may hold (default 1 GiB); returns the previous value.");
  m.def("sparse_latent_attention", &v4::sparse_latent_attention, nb::arg("q"), nb::arg("kv"), nb::arg("idx"),
        nb::arg("scale"), nb::arg("value_dims"), nb::call_guard<nb::gil_scoped_release>(),
        "For tests: the op's sparse attention alone, softmax(q kv[idx]^T scale) kv[idx][:, :value_dims], with autograd.");
  m.def("indexer_scores", &v4::indexer_scores, nb::arg("q"), nb::arg("k"), nb::arg("w"), nb::arg("first"),
        nb::arg("scale"), nb::call_guard<nb::gil_scoped_release>(),
        "For tests: the device kernel's indexer scores [B, Nk] float32; raises where none covers the inputs.");
}
