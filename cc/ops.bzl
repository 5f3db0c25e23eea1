"""The op modules and the compiler flags: the one source that cc/BUILD (through tools/v4.bzl) and
tools/build_ext.py (the Bazel-free build for machines without Bazel) both read. Keep every
assignment a plain literal: build_ext.py parses this file as Python.

An op `v4_<op>` lives at fixed paths: cc/ops/<op>.{h,cc} (ATen compute, no nanobind) and
cc/bind/<op>.cc (NB_MODULE(v4_<op>, m)). Its entry here lists the ops whose C++ it calls
directly (a layer op calls its sub-ops); their libraries are linked into its module.
py/tests and parity/test_registry.py check that this list equals the C++ ops of the Python
registry (py/v4train/ops).
"""

# C++20 as torch's own extensions use; hidden visibility so that only PyInit_* is exported.
V4_COPTS = ["-std=c++20", "-fvisibility=hidden", "-O2", "-Wall", "-Wno-unused-function"]

# nanobind's own sources need this on top of V4_COPTS (its type punning).
V4_NANOBIND_EXTRA_COPTS = ["-fno-strict-aliasing"]

# The CUDA kernels (cc/ops/<op>.cu) are built by tools/build_ext.py where nvcc and a CUDA torch
# exist; each registers its kernels for CUDA tensors (cc/common/backend.h), so no source needs a
# CUDA #define, and the Bazel build (CPU) is the ATen path alone.
V4_NVCC_FLAGS = ["-std=c++20", "-O3", "-gencode=arch=compute_90,code=[sm_90,compute_90]", "--expt-relaxed-constexpr",
                 "-Xcompiler=-fPIC", "-Xcompiler=-fvisibility=hidden", "-Xptxas=-warn-spills"]

# op name -> the ops it calls.
V4_OPS = {
    "v4_rms_norm": [],
    "v4_embedding": [],
    "v4_cross_entropy_loss": [],
    "v4_adam_step": [],
    "v4_clip_grad_norm": [],
    "v4_mlp": [],
    "v4_moe": ["v4_mlp"],
    "v4_mla_dsa_attention": ["v4_rms_norm"],
    "v4_glm5_layer_forward": ["v4_rms_norm", "v4_mlp", "v4_moe", "v4_mla_dsa_attention"],
    "v4_causal_conv1d": [],
    "v4_gated_delta_rule": [],
    "v4_qwen_moe": ["v4_mlp", "v4_moe"],
    "v4_gated_deltanet": ["v4_causal_conv1d", "v4_gated_delta_rule"],
    "v4_gated_attention": ["v4_rms_norm"],
    "v4_qwen3_5_layer_forward": ["v4_rms_norm", "v4_mlp", "v4_qwen_moe", "v4_gated_deltanet", "v4_gated_attention"],
}

# Built like ops (cc/bind/<name>.cc), but no ops: modules that py/tests use.
V4_TEST_MODULES = {
    "v4_bridge_test": [],
}
