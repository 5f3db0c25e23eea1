"""The memory planner (v4train/plan.py, //py:plan): its arithmetic on a small config worked by
hand; its predictions against the peaks measured on one H200 (docs/benchmarks.md), from the
proxies' own configs (tools/bench_model.py builds them); the search for the longest seq_len; the
errors of flags that cannot describe a run; the C++ constants it copies."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
from unittest import mock

import pytest

from v4train import plan
from v4train.hf_checkpoint import read_config
from v4train.models import config_from_dict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import bench_model  # noqa: E402

GIB = 2**30
RELEASED = os.path.join(ROOT, "testdata", "released")
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}

# A GLM-5 of one MoE layer, small enough to count by hand: hidden 256; MLA with 2 heads (nope 64,
# rope 64, v 64; q_lora 128, kv_lora 128); the indexer's 2 heads of 64; 4 routed experts of 128 and
# a shared one; vocabulary 512. FP8 as the release keeps it (the router, weights_proj, embeddings
# and LM head not: "mlp.gate" must not catch the shared expert's gate_proj).
SMALL = {"model_type": "glm_moe_dsa", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 384,
         "moe_intermediate_size": 128, "num_hidden_layers": 1, "first_k_dense_replace": 0, "num_attention_heads": 2,
         "num_key_value_heads": 2, "n_shared_experts": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
         "kv_lora_rank": 128, "q_lora_rank": 128, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64,
         "index_topk": 16, "index_head_dim": 64, "index_n_heads": 2, "max_position_embeddings": 1024,
         "quantization_config": {**FP8, "modules_to_not_convert": ["lm_head", "model.embed_tokens",
                                                                    "self_attn.indexer.weights_proj", "mlp.gate"]}}


def small(**kw) -> plan.Setup:
    return plan.Setup(config_from_dict(SMALL, "SMALL"), SMALL, **{"gpus": 2, "expert_parallel": 2, "lora_r": 4, **kw})


def by_dtype(p: plan.Plan) -> dict[str, int]:
    out = {}
    for w in p.weights:
        out[w.dtype] = out.get(w.dtype, 0) + w.bytes - w.scale_bytes
        out["scales"] = out.get("scales", 0) + w.scale_bytes
    return out


def test_the_weights_of_a_small_config_by_hand():
    """2 GPUs, expert parallel 2: each GPU holds 2 of the 4 experts and FSDP2's half (ceil(rows / 2)
    rows) of every other tensor; FP8 maps are 1 byte a value with a 4-byte scale per 128 x 128
    block, the scales sharded along their own rows."""
    p = plan.plan(small())
    # FP8 values (rows here x columns): q_a 64x256, q_b 128x128, kv_a 96x256, kv_b 128x128, o 128x128,
    # indexer wq_b 64x128, wk 32x256, experts gate_up 2x256x256, down 2x256x128, shared gate and up
    # 64x256 each, shared down 128x128.
    fp8 = 16384 + 16384 + 24576 + 16384 + 16384 + 8192 + 8192 + 131072 + 65536 + 2 * 16384 + 16384
    # Scale blocks here: q_a 1x2, q_b 1x1, kv_a 1x2, kv_b 1x1, o 1x1, wq_b 1x1, wk 1x2, gate_up 2x2x2,
    # down 2x2x1, shared gate 1x2, up 1x2, down 1x1.
    scales = 4 * (2 + 1 + 2 + 1 + 1 + 1 + 2 + 8 + 4 + 2 + 2 + 1)
    # bf16: embed_tokens and lm_head 256x256 each; the final, input and post-attention norms 128
    # each, q_a_layernorm and kv_a_layernorm 64 each, the indexer's k_norm weight and bias 32 each.
    bf16 = 2 * (2 * 256 * 256 + 3 * 128 + 2 * 64 + 2 * 32)
    # fp32: indexer weights_proj 1x256, the router 2x256, e_score_correction_bias 2.
    fp32 = 4 * (256 + 2 * 256 + 2)
    assert by_dtype(p) == {"float8_e4m3fn": fp8, "scales": scales, "bfloat16": bf16, "float32": fp32}
    assert p.weight_bytes == fp8 + scales + bf16 + fp32
    # LoRA r=4 on attention (A [4, in] and B [out, 4], FSDP2 halves of their rows) and on the
    # experts (this GPU's 2 of [4, 4, in] and [4, out, 4]): q_a 2x256 + 64x4, q_b 2x128 + 128x4,
    # kv_a 2x256 + 96x4, kv_b 2x128 + 128x4, o 2x128 + 128x4; gate_up 2x4x256 + 2x256x4, down
    # 2x4x128 + 2x256x4.
    values = 768 + 768 + 896 + 768 + 768 + 4096 + 3072
    assert p.training == plan.Training(parameters=2 * values, gradients=2 * values, moments=8 * values,
                                       masters=4 * values, count=values)


def test_fp8_dequantize_and_no_quantization_config_keep_the_model_dtype():
    dequantized = plan.plan(small(fp8="dequantize"))
    assert "float8_e4m3fn" not in by_dtype(dequantized)
    bf16 = {k: v for k, v in SMALL.items() if k != "quantization_config"}
    setup = plan.Setup(config_from_dict(bf16, "bf16"), bf16, gpus=2, expert_parallel=2, lora_r=4)
    assert plan.plan(setup).weight_bytes == dequantized.weight_bytes


# The peaks measured on one H200 (the seventeenth and twenty-seventh sessions' on an H100; torch 2.11.0+cu130), GiB
# above the weights, copied from docs/benchmarks.md: (proxy, --finetune, tokens, checkpointing, FP8,
# measured GiB, the section, the delta rule's path). bf16 throughout; "full": every weight trains
# but what the family freezes (the bench's mode); "lora": r=16 on attention and experts, every other weight frozen. The path
# (Qwen3.5; GLM-5 has no delta rule), the code's era: "dv_local" for runs with every CUDA kernel of today
# but U in bf16 (the thirty-fifth session's first), "sums" for those before dv_local in bf16 (the
# thirty-fourth), "dqkwg" for those before the key heads' sums in clusters (the twenty-seventh to
# thirty-second sessions), "all" for those before the delta rule's state and intra
# gradients became one kernel (the experts' SwiGLU and the combine too: 2026-12-03 on), "loss" for runs with the LM
# head's loss kernel but those on ATen (stop 31), "block" for runs with the Gated DeltaNet
# block's (the delta rule's, the conv's and the gated norm's) but the loss on ATen, "rule" for runs
# with the delta rule's alone (stops 27-30), None for GLM-5's runs before the loss kernel, "aten"
# for the runs before the delta rule's kernels, when CUDA ran the ATen path the op
# now takes on the CPU: those are predicted by the planner's ATen branch (device "cpu").
ATEN = "The Qwen3.5-MoE proxy with the delta rule's recurrence on CUDA"
FP8_LORA = "FP8 weights against bf16, LoRA (2026-12-02): the same for both"
FUSED = "The delta rule fused into CUDA kernels (2026-12-02, stop 27)"
COMBINE = "The combine as one autograd node, measured (2026-12-02, stop 28)"
BLOCKS = "A checkpointed layer's MoE in blocks of tokens (2026-12-02, stop 28)"
KERNELS = "The Gated DeltaNet block's conv and gated norm as CUDA kernels (2026-12-02, stop 31)"
MOE_KERNELS = "RMSNorm, the experts' SwiGLU and the MoE combine as CUDA kernels (2026-12-03)"
FP8_EXPERTS = "The delta rule's branches merged; the experts' FP8 kernel's first run (2026-12-05, seventeenth session)"
CUTS = "The delta rule's blind instruction cuts measured: 3.27 ms on the device at 8K, fla 2.46 (2026-12-06, twenty-sixth session)"
DQKWG = "The delta rule's state and intra gradients as one kernel: fla's wall time at 8K (2026-12-06, twenty-seventh session)"
SUMS_RUN = "The delta rule's recurrence on Hopper's wgmma: the op past fla at 32K (2026-12-07, thirty-fourth session)"
DV_LOCAL_RUN = "The thirty-fourth session's blind commits on the H100; the experts' narrow tile reverted (2026-12-07, thirty-fifth session)"
MEASURED = [
    ("glm5", "full", 4096, False, False, 14.5, COMBINE, None),
    ("glm5", "full", 16384, True, False, 20.3, BLOCKS, None),
    ("glm5", "full", 65536, True, False, 50.1, BLOCKS, None),
    ("glm5", "full", 131072, True, False, 96.6, BLOCKS, None),
    ("qwen3_5", "full", 4096, False, False, 19.4, ATEN, "aten"),
    ("glm5", "lora", 4096, False, True, 13.9, FP8_LORA, None),
    ("glm5", "lora", 4096, False, False, 13.9, FP8_LORA, None),
    ("qwen3_5", "lora", 4096, False, True, 17.4, FP8_LORA, "aten"),
    ("qwen3_5", "lora", 4096, False, False, 17.4, FP8_LORA, "aten"),
    ("full_layer", "lora", 4096, False, True, 14.1, "FP8 weights against bf16, LoRA (2026-12-02): --full_layer", None),
    ("qwen3_5", "full", 4096, False, False, 16.3, COMBINE, "rule"),
    ("qwen3_5", "full", 65536, True, False, 35.0, BLOCKS, "rule"),
    ("qwen3_5", "full", 131072, True, False, 67.5, BLOCKS, "rule"),
    ("qwen3_5", "full", 4096, False, False, 12.9, KERNELS, "block"),
    ("qwen3_5", "full", 65536, True, False, 20.0, KERNELS, "block"),
    ("qwen3_5", "full", 4096, False, False, 6.3, KERNELS, "loss"),
    ("glm5", "full", 4096, False, False, 12.8, KERNELS, "loss"),
    ("qwen3_5", "full", 4096, False, False, 6.1, MOE_KERNELS, "all"),
    ("glm5", "full", 4096, False, False, 12.8, MOE_KERNELS, "all"),
    ("glm5", "lora", 4096, False, True, 8.8, FP8_EXPERTS, "all"),
    ("glm5", "lora", 4096, False, False, 8.8, FP8_EXPERTS, "all"),
    ("full_layer", "lora", 4096, False, True, 3.4, FP8_EXPERTS, "all"),
    ("qwen3_5", "full", 65536, True, False, 19.5, CUTS, "all"),
    ("qwen3_5", "full", 4096, False, False, 5.9, DQKWG, "dqkwg"),
    ("qwen3_5", "full", 65536, True, False, 17.5, DQKWG, "dqkwg"),
    ("qwen3_5", "full", 4096, False, False, 5.9, SUMS_RUN, "sums"),
    ("qwen3_5", "full", 65536, True, False, 15.0, SUMS_RUN, "sums"),
    ("qwen3_5", "full", 65536, True, False, 14.8, DV_LOCAL_RUN, "dv_local"),
]
TOLERANCE = 0.10
# The CUDA kernels that each era's code lacked (it ran their ATen paths): the planner leaves them out.
MOE = ("fused_swiglu", "fused_combine")  # the experts' SwiGLU and combine kernels (2026-12-03)
# "all": the kernels up to the twenty-sixth session (the delta rule's state and intra gradients as three
# kernels); "dqkwg": those as one, from the twenty-seventh.
# Every era here but "sums" wrote each value head's share of dq and dk in fp32 and summed them after (the
# plane kernels sum them in clusters since the thirty-third session: fused_key_sums), and every one kept
# dv_local in fp32 (bf16 on planes since the thirty-fourth: fused_bf16_dv_local); every one, "dv_local" too,
# kept U in fp32 (bf16 on planes since the thirty-fifth: fused_bf16_u).
U = ("fused_bf16_u",)
DV_LOCAL = ("fused_bf16_dv_local",) + U
SUMS = ("fused_key_sums",) + DV_LOCAL
LACKED = {"rule": ("fused_conv", "fused_norm", "fused_loss", "fused_dqkwg") + MOE + SUMS,
          "block": ("fused_loss", "fused_dqkwg") + MOE + SUMS,
          None: ("fused_loss", "fused_fp8_experts", "fused_dqkwg") + MOE + SUMS,
          "loss": ("fused_dqkwg",) + MOE + SUMS, "all": ("fused_dqkwg",) + SUMS, "dqkwg": SUMS, "sums": DV_LOCAL,
          "dv_local": U}
# The delta rule's two paths measured on the same code otherwise (the combine before it became
# one node, stop 27, which both had alike): what the fused path saves is their difference.
SAVING = [
    ("qwen3_5", "full", 4096, False, False, 19.4, ATEN, "aten"),
    ("qwen3_5", "full", 65536, True, False, 55.9, ATEN, "aten"),
    ("qwen3_5", "full", 131072, True, False, 110.7, ATEN, "aten"),
    ("qwen3_5", "full", 4096, False, False, 16.3, FUSED, "rule"),
    ("qwen3_5", "full", 65536, True, False, 39.4, FUSED, "rule"),
    ("qwen3_5", "full", 131072, True, False, 77.6, FUSED, "rule"),
]


def proxy_config(name: str, fp8: bool) -> dict:
    """The benchmark's model: tools/bench_model.py's proxy config, or --full_layer's; with --fp8
    every linear map of its layers is quantised (bench_model.fp8_pair), which an FP8
    quantization_config that converts every module says."""
    config = bench_model.full_layer_config() if name == "full_layer" else bench_model.PROXIES[name]()[0].to_dict()
    return {**config, "quantization_config": {**FP8, "modules_to_not_convert": []}} if fp8 else config


def predicted(name, finetune, tokens, checkpointing, fp8, path=None) -> float:
    """The peak above the weights the bench measures (max_memory_allocated during a forward +
    backward, from after its warm-up): the planner's activation peak, the full fine-tune's
    gradients in it, and LoRA's gradients. path: the code's era (MEASURED); "aten": the delta
    rule's ATen path, the planner's device "cpu"."""
    config = proxy_config(name, fp8)
    setup = plan.Setup(config_from_dict(config, name), config, finetune=finetune, fp8="keep" if fp8 else "dequantize",
                       seq_len=tokens, micro_batch_size=1, checkpointing=checkpointing, lora_r=16,
                       lora_target_modules=("attention",), lora_experts=True, documents=(tokens,),
                       device="cpu" if path == "aten" else "cuda")
    with contextlib.ExitStack() as stack:
        for kernels in LACKED.get(path, ()):  # what the measured code ran on ATen
            stack.enter_context(mock.patch.object(plan, kernels, lambda *args: False))
        p = plan.plan(setup)
    return (p.peak.bytes + (p.training.gradients if finetune == "lora" else 0)) / GIB


@pytest.mark.parametrize("name,finetune,tokens,checkpointing,fp8,measured,source,path", MEASURED,
                         ids=[f"{m[0]}-{m[1]}-{m[2]}" + "-ckpt" * m[3] + "-fp8" * m[4] + f"-{m[7]}" * (m[7] is not None)
                              for m in MEASURED])
def test_the_prediction_is_within_10_percent_of_the_measured_peak(name, finetune, tokens, checkpointing, fp8, measured,
                                                                    source, path):
    got = predicted(name, finetune, tokens, checkpointing, fp8, path)
    rule = f" delta rule {path}" if path else ""
    print(f"{name} {finetune} {tokens} ckpt={checkpointing} fp8={fp8}{rule}: predicted {got:.1f} GiB, measured "
          f"{measured} ({100 * (got / measured - 1):+.1f}%; docs/benchmarks.md, {source})")
    assert abs(got / measured - 1) <= TOLERANCE


FUSED_ROWS = [m for m in SAVING if m[7] == "rule"]


@pytest.mark.parametrize("name,finetune,tokens,checkpointing,fp8,measured,source,path", FUSED_ROWS,
                         ids=[f"{m[0]}-{m[1]}-{m[2]}" + "-ckpt" * m[3] for m in FUSED_ROWS])
def test_the_fused_delta_rule_saves_what_was_measured(name, finetune, tokens, checkpointing, fp8, measured, source,
                                                      path):
    """What the fused path saves against the ATen path, both measured on the same proxy at the
    same length (the rest of the step alike), predicted within 10% of the measured saving: the
    delta rule's terms alone, which the peaks' 10% judges only in a sum (the fused path without
    its states h passes that, not this)."""
    aten = next(m for m in SAVING if m[:5] == (name, finetune, tokens, checkpointing, fp8) and m[7] == "aten")
    args = (name, finetune, tokens, checkpointing, fp8)
    got, saving = predicted(*args, "aten") - predicted(*args, "rule"), aten[5] - measured
    print(f"{name} {finetune} {tokens}: the fused delta rule saves {got:.2f} GiB predicted, {saving:.1f} measured "
          f"({100 * (got / saving - 1):+.1f}%)")
    assert abs(got / saving - 1) <= TOLERANCE


def test_the_delta_rule_is_planned_on_the_path_the_op_takes():
    """gated_delta_rule.cc runs its fused CUDA kernels for CUDA tensors of one dtype other than
    float64 with heads at most kFusedMaxDim wide, the ATen path otherwise; the planner's Gated
    DeltaNet terms follow (the fused node keeps v_new, the ATen graph the UT solve's result)."""
    config = proxy_config("qwen3_5", False)
    base = plan.Setup(config_from_dict(config, "qwen3_5"), config, seq_len=4096)

    def kept(setup):
        return {plan.key(t) for t in plan.qwen3_5_layer(plan._ctx(setup, (4096,)), 0).saved}

    assert "gdr_v_new" in kept(base) and "gdr_v_new" in kept(dataclasses.replace(base, dtype_bytes=4))
    assert "gdr_uw" in kept(dataclasses.replace(base, device="cpu"))
    wide = {**config, "linear_value_head_dim": 2 * plan.FUSED_MAX_DIM}
    assert "gdr_uw" in kept(dataclasses.replace(base, cfg=config_from_dict(wide, "wide"), hf_config=wide))


def test_the_fused_delta_rule_keeps_v_new_as_its_kernels_store_it():
    """The fused node keeps v_new [P, value heads, dv]: bf16 on the plane kernels (bf16 at widths
    128, gated_delta_rule.cu's forward recurrence writes it so), fp32 otherwise. The bytes by hand."""
    config = proxy_config("qwen3_5", False)
    base = plan.Setup(config_from_dict(config, "qwen3_5"), config, seq_len=4096)
    nv, dv = config["linear_num_value_heads"], config["linear_value_head_dim"]

    def v_new(setup):
        (t,) = [t for t in plan.qwen3_5_layer(plan._ctx(setup, (4096,)), 0).saved if plan.key(t) == "gdr_v_new"]
        return t.bytes

    assert v_new(base) == 4096 * nv * dv * 2
    assert v_new(dataclasses.replace(base, dtype_bytes=4)) == 4096 * nv * dv * 4


def test_the_fused_forward_holds_u_as_its_kernels_store_it():
    """The fused forward's work holds U [P, value heads, dv] (prepare's output, the recurrence's base):
    bf16 on the plane kernels (gated_delta_rule.cu's prepare_planes_kernel writes it so), fp32
    otherwise and before fused_bf16_u; beside W and K~ [P, value heads, dk] in fp32 and the chunks'
    decays. The bytes by hand."""
    config = proxy_config("qwen3_5", False)
    base = plan.Setup(config_from_dict(config, "qwen3_5"), config, seq_len=4096)
    nv, dk, dv = config["linear_num_value_heads"], config["linear_key_head_dim"], config["linear_value_head_dim"]
    P, chunks = 4096, 4096 // 64

    def work(setup):
        (t,) = [t for m in plan.qwen3_5_layer(plan._ctx(setup, (4096,)), 0).forward if m.label == "gated delta rule"
                for t in m.terms if t.what.startswith("delta rule forward:")]
        return t.bytes

    rest = 2 * P * nv * dk * 4 + chunks * nv * 4
    assert work(base) == P * nv * dv * 2 + rest
    with mock.patch.object(plan, "fused_bf16_u", lambda *args: False):
        assert work(base) == P * nv * dv * 4 + rest
    assert work(dataclasses.replace(base, dtype_bytes=4)) == P * nv * dv * 4 + rest


def test_the_reverse_recurrence_on_planes_holds_e_q_where_fp32_holds_dh_local():
    """The fused backward's reverse recurrence holds dv_local [P, value heads, dv] and dv_new (bf16 on
    the plane kernels, which write them so, dv_new as v_new; fp32 otherwise), d_state (as h) and the state's
    gradient from each chunk's outputs: on the plane kernels (bf16 at widths 128) E Q [P, value heads,
    dk] in bf16, which the recurrence forms it from; in fp32, local_grads' dh_local [chunks, value
    heads, dk, dv] in fp32. The term by hand, both dtypes."""
    config = proxy_config("qwen3_5", False)
    base = plan.Setup(config_from_dict(config, "qwen3_5"), config, seq_len=4096)
    nv, dk, dv = config["linear_num_value_heads"], config["linear_key_head_dim"], config["linear_value_head_dim"]
    assert dk == dv == 128
    P, chunks = 4096, 4096 // 64

    def term(setup):
        (moment,) = [m for m in plan.qwen3_5_layer(plan._ctx(setup, (4096,)), 0).backward
                     if m.label == "delta rule's reverse recurrence"]
        (t,) = [t for t in moment.terms if t.what.startswith("reverse recurrence:")]
        return t.bytes

    assert term(base) == P * nv * dv * (2 + 2) + P * nv * dk * 2 + chunks * nv * dk * dv * 2
    with mock.patch.object(plan, "fused_bf16_dv_local", lambda *args: False):  # dv_local in fp32 before
        assert term(base) == P * nv * dv * (4 + 2) + P * nv * dk * 2 + chunks * nv * dk * dv * 2
    assert term(dataclasses.replace(base, dtype_bytes=4)) == 2 * P * nv * dv * 4 + 2 * chunks * nv * dk * dv * 4


def test_the_conv_and_the_gated_norm_are_planned_on_the_path_the_ops_take():
    """causal_conv1d.cc and gated_deltanet.cc run their CUDA kernels for CUDA tensors in bf16 or
    fp32 with at most kMaxKernel taps and heads at most kMaxNormWidth wide (their nodes keep the
    inputs), the ATen path otherwise (its graph keeps fp32 products)."""
    config = proxy_config("qwen3_5", False)
    base = plan.Setup(config_from_dict(config, "qwen3_5"), config, seq_len=4096)

    def kept(setup):
        return {plan.key(t) for t in plan.qwen3_5_layer(plan._ctx(setup, (4096,)), 0).saved}

    assert not {"conv_taps", "norm_out"} & kept(base)
    assert {"conv_taps", "norm_out"} <= kept(dataclasses.replace(base, device="cpu"))
    long_conv = {**config, "linear_conv_kernel_dim": plan.CONV_MAX_KERNEL + 1}
    wide = {**config, "linear_value_head_dim": 2 * plan.NORM_MAX_WIDTH}
    assert "conv_taps" in kept(dataclasses.replace(base, cfg=config_from_dict(long_conv, "long"), hf_config=long_conv))
    assert "norm_out" in kept(dataclasses.replace(base, cfg=config_from_dict(wide, "wide"), hf_config=wide))


def test_the_peak_grows_with_the_sequence_and_checkpointing_lowers_it():
    config = proxy_config("glm5", False)
    base = plan.Setup(config_from_dict(config, "glm5"), config, micro_batch_size=1, checkpointing=False)
    peaks = [plan.plan(dataclasses.replace(base, seq_len=n)).peak.bytes for n in (1024, 2048, 4096)]
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1]
    assert plan.plan(dataclasses.replace(base, seq_len=4096, checkpointing=True)).peak.bytes < peaks[-1]


def test_a_checkpointed_layer_runs_its_tail_in_blocks_of_tokens():
    """checkpoint.cc tail_block: a checkpointed call's MLP / MoE takes max(1, kTailBlockMiB MiB //
    (rows (2 H + 4 I) bytes)) tokens at a time (rows: top-k for an MoE, 1 for an MLP), at most T;
    one block under expert parallelism; a plain call all T. The tail's saved tensors follow, the
    head's (h) stay on T."""

    def setup(name, tokens, **kw):
        config = proxy_config(name, False)
        return plan.Setup(config_from_dict(config, name), config, finetune="full", fp8="dequantize", seq_len=tokens,
                          **kw)

    def block(name, layer, tokens, **kw):
        return plan.tail_tokens(plan._ctx(setup(name, tokens, **kw), (tokens,)), layer)

    # GLM-5 proxy, an MoE layer: 8 rows of 2 x 6144 + 4 x 2048 bf16 values, 327,680 bytes a token:
    # 2^31 // 327,680 = 6,553 (in fp32 655,360 bytes: 3,276); its dense layer 0, 1 row of
    # 2 x 6144 + 4 x 12288: 122,880 bytes, 17,476. Qwen3.5 proxy: 8 x (2 x 2048 + 4 x 512) x 2 =
    # 98,304 bytes, 21,845.
    assert block("glm5", 1, 65536) == 6553
    assert block("glm5", 1, 65536, dtype_bytes=4) == 3276
    assert block("glm5", 0, 65536) == 17476
    assert block("qwen3_5", 0, 131072) == 21845
    assert block("glm5", 1, 4096) == 4096
    assert block("glm5", 1, 65536, gpus=2, expert_parallel=2) == 65536
    assert block("glm5", 1, 65536, checkpointing=False) == 65536

    def saved(checkpointing):
        s = setup("glm5", 65536, checkpointing=checkpointing)
        return {plan.key(t): t.bytes for t in plan.glm5_layer(plan._ctx(s, (65536,)), 1).saved}

    H, k = 6144, 8
    assert saved(True)["rows"] == 6553 * k * H * 2 and saved(False)["rows"] == 65536 * k * H * 2
    assert saved(True)["h"] == saved(False)["h"] == 65536 * H * 2


def released(name: str, **kw) -> plan.Setup:
    hf_config, cfg = read_config(os.path.join(RELEASED, name, "config.json"))
    return plan.Setup(cfg, hf_config, **{"gpus": 8, "expert_parallel": 8, "micro_batch_size": 1, "checkpointing": True,
                                         **kw})


@pytest.mark.parametrize("name", ["GLM-5-FP8", "Qwen3.5-397B-A17B-FP8"])
def test_the_longest_seq_len_fits_and_one_step_more_does_not(name):
    setup = released(name)
    longest = plan.longest_seq_len(setup)
    assert longest > 0 and longest % plan.SEQ_LEN_STEP == 0
    assert plan.plan(dataclasses.replace(setup, seq_len=longest)).fits
    assert not plan.plan(dataclasses.replace(setup, seq_len=longest + plan.SEQ_LEN_STEP)).fits


def test_the_longest_seq_len_is_monotone_in_memory_and_batch():
    setup = released("Qwen3.5-397B-A17B-FP8")
    by_memory = [plan.longest_seq_len(dataclasses.replace(setup, gpu_memory_gib=m)) for m in (80, 100, 139)]
    assert by_memory == sorted(by_memory) and by_memory[0] < by_memory[-1]
    by_batch = [plan.longest_seq_len(dataclasses.replace(setup, micro_batch_size=b)) for b in (1, 2)]
    assert by_batch[1] < by_batch[0]


def test_the_released_weights_are_the_published_sizes():
    """744B weights for GLM-5 and 397B for Qwen3.5 (their vision tower and MTP layers aside): on 8
    GPUs at expert parallel 8, an eighth of each in FP8 and little more."""
    for name, billions in (("GLM-5-FP8", 743.9), ("Qwen3.5-397B-A17B-FP8", 396.3)):
        p = plan.plan(released(name))
        assert round(sum(_numel(w.shape) for w in p.weights) / 1e9, 1) == billions
        fp8 = sum(w.bytes for w in p.weights if w.dtype == "float8_e4m3fn")
        assert 0.95 * billions * 1e9 / 8 < fp8 < billions * 1e9 / 8


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


@pytest.mark.parametrize("kw,flags", [
    (dict(expert_parallel=3, gpus=3), ("--expert_parallel=3", "n_routed_experts=4")),
    (dict(expert_parallel=2, gpus=3), ("--expert_parallel=2", "--gpus=3")),
    (dict(finetune="full"), ("--finetune=full", "--fp8=keep", "--fp8=dequantize")),
    (dict(lora_target_modules=("nothing",)), ("--lora_target_modules=nothing",)),
    (dict(gpu_memory_gib=0.0), ("--gpu_memory_gib=0.0",)),
])
def test_a_bad_flag_is_an_error_naming_it(kw, flags):
    with pytest.raises(plan.PlanError) as e:
        plan.plan(small(**kw))
    for flag in flags:
        assert flag in str(e.value)


def run_plan(*args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "py"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, os.path.join(ROOT, "py", "plan.py"), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


def test_the_command_prints_the_plan_and_its_json(tmp_path):
    r = run_plan("--model_dir=testdata/released/Qwen3.5-397B-A17B-FP8", "--gpus=8", "--expert_parallel=8",
                 "--seq_len=4096", "--micro_batch_size=1", "--gradient_checkpointing")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    p = plan.plan(released("Qwen3.5-397B-A17B-FP8", seq_len=4096))
    assert result["total_bytes"] == p.total_bytes and result["fits"] is True
    assert result["longest_seq_len"] == plan.longest_seq_len(released("Qwen3.5-397B-A17B-FP8"))
    assert any(line.startswith("headroom") for line in lines) and "longest --seq_len" in r.stdout
    # A missing config names the flag and the file it looked for.
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run_plan(f"--model_dir={empty}")
    assert r.returncode == 2 and "--model_dir" in r.stderr and "config.json" in r.stderr
    r = run_plan(f"--model_config={tmp_path / 'missing.json'}")
    assert r.returncode == 2 and "--model_config" in r.stderr and "not found" in r.stderr


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_the_gated_deltanet_terms_are_what_autograd_keeps_of_the_cpp_op(finetune):
    """The planner's Gated DeltaNet terms, its ATen branch (device "cpu"), against the storages
    autograd keeps from the C++ op itself on the CPU, where the delta rule takes its ATen path (on
    CUDA its fused kernels, whose terms the measured peaks check): two documents (each padded to
    chunks of 64), bf16; LoRA on attention or every weight trained. Outside Bazel it needs the op
    built (tools/build_ext.py, its folder on PYTHONPATH)."""
    import torch

    from v4train import lora, ops
    from v4train.model import CausalLM

    with open(os.path.join(ROOT, "testdata", "sft", "qwen3_5_config.json")) as f:
        config = json.load(f)
    cfg = config_from_dict(config, "qwen3_5_config.json")
    documents, r = (100, 156), 4
    model = CausalLM.random(cfg, config, torch.bfloat16)
    if finetune == "lora":
        lcfg = lora.LoraConfig(r, 2.0 * r, 0.0, lora.expand_targets(model, ["attention"]), True)
        trained = lora.add_adapters(model, lcfg, torch.bfloat16, "cpu", seed=0)
        for n, p in model.named_parameters():
            p.requires_grad_(n in trained)
    else:
        for n, p in model.named_parameters():
            p.requires_grad_(not model.family.is_frozen(n))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    T = sum(documents)
    h = torch.randn(T, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    cu_seqlens = torch.tensor([0, documents[0], T])
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    try:
        deltanet = ops.resolve("v4_gated_deltanet").v4_gated_deltanet
    except ops.CppOpUnavailable as e:
        if "TEST_SRCDIR" in os.environ:  # under Bazel the ops are built: never skipped there
            raise
        pytest.skip(f"{e}")
    layer = model.layers[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        deltanet(
            h, layer.weights.linear_attn, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim, cfg.rms_norm_eps, cu_seqlens, layer.lora_scaling, 0.0)
    setup = plan.Setup(cfg, config, finetune=finetune, fp8="dequantize", seq_len=T, lora_r=r, documents=documents,
                       device="cpu")
    terms = plan.qwen3_5_layer(plan._ctx(setup, documents), 0).saved
    predicted = sum(t.bytes for t in terms.before("mid") if plan.key(t) != "norms")  # the block's, not the norms'
    print(f"{finetune}: predicted {predicted:,} bytes, autograd keeps {sum(kept.values()):,}")
    assert abs(predicted / sum(kept.values()) - 1) < 0.02


def _full_layer_fp8() -> plan.Setup:
    """GLM-5's decoder layer at full width (bench_model's --full_layer), FP8 kept, LoRA r=16 on attention
    and experts, 4,096 tokens on CUDA."""
    config = proxy_config("full_layer", True)
    return plan.Setup(config_from_dict(config, "full_layer"), config, finetune="lora", fp8="keep", seq_len=4096,
                      micro_batch_size=1, checkpointing=False, lora_r=16, lora_target_modules=("attention",),
                      lora_experts=True, documents=(4096,), device="cuda")


def _gate_up_backward_bytes(monkeypatch, variable: str, values: tuple[str, ...]) -> dict[str, int]:
    """The full layer's moment "experts' gate_up backward", in bytes, under each value of `variable`."""
    setup, total = _full_layer_fp8(), {}
    for value in values:
        monkeypatch.setenv(variable, value)
        layer = plan.glm5_layer(plan._ctx(setup, (4096,)), 0)
        (moment,) = [m for m in layer.backward if m.label == "experts' gate_up backward"]
        total[value] = sum(t.bytes for t in moment.terms)
    return total


def test_the_experts_on_fp8_tensor_cores_plan_their_quantised_gradients(monkeypatch):
    """V4TRAIN_FP8_TENSOR_CORES=experts: in GLM-5's full-width FP8 layer the experts' gate_up backward
    also holds its output's gradient quantised for the products on FP8 tensor cores: fp8.cuh's
    quantize_rows of [T k, 2I] = [4,096 x 8, 4,096], a byte a value and an fp32 scale per 128 (rows
    already a multiple of 16): 32,768 x 4,096 + 32,768 x 32 x 4 bytes more than with `none` (the
    e4m3 kernels' variants off: their weights turned are the next test's)."""
    monkeypatch.setenv("V4TRAIN_FP8_E4M3_VARIANTS", "none")
    total = _gate_up_backward_bytes(monkeypatch, "V4TRAIN_FP8_TENSOR_CORES", ("none", "experts"))
    assert total["experts"] - total["none"] == 32768 * 4096 + 32768 * 32 * 4
    monkeypatch.setenv("V4TRAIN_FP8_TENSOR_CORES", "experts,dense")
    with pytest.raises(ValueError, match="V4TRAIN_FP8_TENSOR_CORES=experts,dense: unknown product 'dense'"):
        plan.plan(_full_layer_fp8())


def test_the_experts_weights_turned_once_plan_their_group(monkeypatch):
    """V4TRAIN_FP8_E4M3_VARIANTS=transpose_global (with the experts on FP8 tensor cores), which unset
    (or empty) means too: GLM-5's full-width gate_up backward also holds a group of its 256 experts'
    FP8 weights turned, each 4,096 x 6,144 bytes (25,165,824), at most a quarter of them (64) and
    256 MiB (10 of them): 251,658,240 bytes, and all their scales turned, 256 x 32 x 48 fp32
    (1,572,864 bytes); `wide` alone, none."""
    monkeypatch.setenv("V4TRAIN_FP8_TENSOR_CORES", "experts")
    total = _gate_up_backward_bytes(monkeypatch, "V4TRAIN_FP8_E4M3_VARIANTS",
                                    ("none", "wide", "wide,transpose_global", ""))
    assert total["wide,transpose_global"] - total["none"] == 251_658_240 + 1_572_864
    assert total[""] == total["wide,transpose_global"] and total["wide"] == total["none"]
    monkeypatch.setenv("V4TRAIN_FP8_E4M3_VARIANTS", "wide,turned")
    with pytest.raises(ValueError, match="V4TRAIN_FP8_E4M3_VARIANTS=wide,turned: unknown variant 'turned'"):
        plan.plan(_full_layer_fp8())


def test_the_e4m3_variants_are_the_cpp_ops_words(monkeypatch):
    """plan.py reads V4TRAIN_FP8_E4M3_VARIANTS as cc/common/fp8_grouped.cu does: the same words, and
    unset the same ones (the C++ mask's enumerators, bit i naming word i)."""
    with open(os.path.join(ROOT, "cc", "common", "fp8_grouped.cu")) as f:
        text = f.read()
    ((names, unset),) = re.findall(r'env_variants\("V4TRAIN_FP8_E4M3_VARIANTS", \{([^}]*)\}, ([^)]*)\)', text)
    words = tuple(re.findall(r'"(\w+)"', names))
    assert words == plan.E4M3_VARIANTS
    (enum,) = re.findall(r"enum E4m3Variant : unsigned \{([^}]*)\}", text)
    bits = {name: int(value) for name, value in re.findall(r"(\w+) = (\d+)", enum)}
    mask = sum(bits[name.strip()] for name in unset.split("|"))
    monkeypatch.delenv("V4TRAIN_FP8_E4M3_VARIANTS", raising=False)
    assert plan.e4m3_variants() == {word for i, word in enumerate(words) if mask >> i & 1}


def test_the_fp8_tensor_core_products_are_the_cpp_ops_words():
    """plan.py reads V4TRAIN_FP8_TENSOR_CORES as cc/common/lora.cc does: the same words."""
    with open(os.path.join(ROOT, "cc", "common", "lora.cc")) as f:
        words = re.findall(r'word == "(\w+)"\) mask \|= kFp8\w+;', f.read())
    assert tuple(words) == plan.FP8_TENSOR_CORE_PRODUCTS


@pytest.mark.parametrize("name,path,pattern", [
    ("MASKED_MAX_LEN", "models/glm5/glm5_layer_forward.cc", r"kMaskedMaxLen = (\d+);"),
    ("BLOCK_BYTES", "models/glm5/mla_dsa_attention.cc", r"block_bytes\{int64_t\{1\} << (\d+)\}"),
    ("GDR_CHUNK", "ops/gated_delta_rule.h", r"kChunk = (\d+);"),
    ("FUSED_MAX_DIM", "ops/gated_delta_rule.h", r"kFusedMaxDim = (\d+);"),
    ("GDR_MAX_CLUSTER", "ops/gated_delta_rule.cu", r"kMaxCluster = (\d+);"),
    ("CONV_MAX_KERNEL", "ops/causal_conv1d.h", r"kMaxKernel = (\d+);"),
    ("NORM_MAX_WIDTH", "models/qwen3_5/gated_deltanet.h", r"kMaxNormWidth = (\d+);"),
    ("COMBINE_MAX_SLOTS", "common/experts.h", r"kCombineMaxSlots = (\d+)"),
    ("COMBINE_MAX_ROW_BYTES", "common/experts.h", r"kCombineMaxRowBytes = (\d+);"),
    ("COMBINE_BLOCK_MIB", "common/experts.cc", r"kCombineBlockMiB = (\d+);"),
    ("TAIL_BLOCK_MIB", "common/checkpoint.h", r"kTailBlockMiB = (\d+);"),
    ("TURN_MIB", "common/fp8_grouped.cu", r"kTurnBytes = int64_t\((\d+)\) << 20;"),
])
def test_the_constants_copied_from_the_cpp_ops_are_theirs(name, path, pattern):
    with open(os.path.join(ROOT, "cc", path)) as f:
        value = int(re.search(pattern, f.read()).group(1))
    assert getattr(plan, name) == (2**value if name == "BLOCK_BYTES" else value)
