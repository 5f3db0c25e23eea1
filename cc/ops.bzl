"""The op modules: one importable nanobind module per op.

Read by cc/BUILD (through v4_op_module) and by tools/build_ext.py (the Bazel-free build for
machines without Bazel), so this dict literal is the only list of modules. Keep it a plain
literal: build_ext.py parses it as Python.

module name -> {"bind": the NB_MODULE source, "srcs": the ATen sources (each with its .h)}
V4_TEST_MODULES are built the same way but are no ops (py/tests use them).
"""

V4_OPS = {
    "v4_rms_norm": {"bind": "bind/rms_norm.cc", "srcs": ["ops/rms_norm.cc"]},
    "v4_adam_step": {"bind": "bind/adam_step.cc", "srcs": ["ops/adam_step.cc"]},
    "v4_clip_grad_norm": {"bind": "bind/clip_grad_norm.cc", "srcs": ["ops/clip_grad_norm.cc"]},
    "v4_embedding": {"bind": "bind/embedding.cc", "srcs": ["ops/embedding.cc"]},
    "v4_cross_entropy_loss": {"bind": "bind/cross_entropy_loss.cc", "srcs": ["ops/cross_entropy_loss.cc"]},
}

V4_TEST_MODULES = {
    "v4_bridge_test": {"bind": "bind/bridge_test.cc", "srcs": []},
}
