"""The op modules and the compiler flags: the one source that cc/BUILD (through tools/v4.bzl) and
tools/build_ext.py (the Bazel-free build for machines without Bazel) both read. Keep every
assignment a plain literal: build_ext.py parses this file as Python.

An op `v4_<op>` lives in a folder of cc/: cc/ops for the blocks the families share,
cc/models/<family> for a family's own (its layer op, its attention, its router). In that folder
DIR: DIR/<op>.{h,cc} (ATen compute, no nanobind), DIR/<op>.cu (CUDA kernels, if any) and
DIR/bind/<op>.cc (NB_MODULE(v4_<op>, m)). Its entry here is (DIR, the ops whose C++ it calls
directly: a layer op calls its sub-ops; their libraries are linked into its module).
tools/tools_test.py checks that this list equals the C++ ops of the Python registry
(py/v4train/ops).
"""

# C++20 as torch's own extensions use; hidden visibility so that only PyInit_* is exported.
V4_COPTS = ["-std=c++20", "-fvisibility=hidden", "-O2", "-Wall", "-Wno-unused-function"]

# nanobind's own sources need this on top of V4_COPTS (its type punning).
V4_NANOBIND_EXTRA_COPTS = ["-fno-strict-aliasing"]

# The CUDA kernels (cc/ops/<op>.cu) are built by tools/build_ext.py where nvcc and a CUDA torch
# exist; each registers its kernels for CUDA tensors (cc/common/backend.h), so no source needs a
# CUDA #define, and the Bazel build (CPU) is the ATen path alone. sm_90a machine code (Hopper's
# wgmma, cc/common/wgmma.cuh) and compute_90 PTX, which later GPUs compile (without wgmma).
V4_NVCC_FLAGS = ["-std=c++20", "-O3", "-gencode=arch=compute_90a,code=sm_90a",
                 "-gencode=arch=compute_90,code=compute_90", "--expt-relaxed-constexpr",
                 "-Xcompiler=-fPIC", "-Xcompiler=-fvisibility=hidden", "-Xptxas=-warn-spills",
                 "-lineinfo"]  # source lines for Nsight Compute; no cost at run time

# op name -> (its folder under cc/, the ops it calls).
V4_OPS = {
    "v4_rms_norm": ("ops", []),
    "v4_embedding": ("ops", []),
    "v4_cross_entropy_loss": ("ops", []),
    "v4_adam_step": ("ops", []),
    "v4_clip_grad_norm": ("ops", []),
    "v4_mlp": ("ops", []),
    "v4_causal_conv1d": ("ops", []),
    "v4_gated_delta_rule": ("ops", []),
    "v4_glm5_moe": ("models/glm5", ["v4_mlp"]),
    "v4_mla_dsa_attention": ("models/glm5", ["v4_rms_norm"]),
    "v4_glm5_layer_forward": ("models/glm5", ["v4_rms_norm", "v4_mlp", "v4_glm5_moe", "v4_mla_dsa_attention"]),
    "v4_qwen3_5_moe": ("models/qwen3_5", ["v4_mlp"]),
    "v4_gated_deltanet": ("models/qwen3_5", ["v4_causal_conv1d", "v4_gated_delta_rule"]),
    "v4_gated_attention": ("models/qwen3_5", ["v4_rms_norm"]),
    "v4_qwen3_5_layer_forward": ("models/qwen3_5", ["v4_rms_norm", "v4_mlp", "v4_qwen3_5_moe", "v4_gated_deltanet",
                                                    "v4_gated_attention"]),
}

# Built like ops, but no ops: modules that py/tests use.
V4_TEST_MODULES = {
    "v4_bridge_test": ("ops", []),
    "v4_linear_test": ("ops", []),
}
