"""Mutation check of the parity suite: applies realistic kernel bugs to the C++ sources one at a
time, rebuilds the ops (tools/build_ext.py, into build/mutants; the CUDA ones side by side, each in a
copy of the sources under a temporary folder), runs the parity tests that
should catch each, and reports caught or survived. Every mutation must be caught: a survivor is a
missing test, not a mutation to drop. docs/testing.md lists them and what catches each.

    tools/bazel run //tools:mutants                  # all (about 20 minutes on 2 cores)
    tools/bazel run //tools:mutants -- --only rms_norm_backward_projection,moe_slot_off_by_one
    python3 tools/mutants.py --cuda                  # the CUDA kernels' bugs, on the GPU machine

The CUDA mutations (`--cuda`) are built with nvcc and judged by the CUDA parity cases under the
hypothesis profile `mutant` (the ci profile without shrinking); without `--cuda` only the others run.

Each source is restored after its mutation, whatever happens; the unmutated build must pass
the same tests first (else every mutation would look caught).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.environ.get("BUILD_WORKSPACE_DIRECTORY") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    path: str  # relative to the repository
    find: str  # must occur exactly once
    replace: str
    tests: tuple[str, ...]  # pytest arguments: files and an --op, or node ids
    cuda: bool = False  # a CUDA kernel's bug: built with nvcc, judged on the GPU (--cuda)
    module: str = ""  # the module to build for a shared kernel file (cc/common/*.cu, in every module)


# The GLM-5 sparse attention's device kernels: each alone against its float64 truth, and the layer.
SPARSE_CUDA = ("parity/test_mla_dsa_attention.py", "-k", "cuda and (alone or widths)")
# The delta rule's kernels: the op's CUDA cases, Qwen3.5's widths over document and chunk boundaries among them.
DELTA_RULE_CUDA = ("parity/test_ops.py", "parity/test_gated_delta_rule.py", "--op=v4_gated_delta_rule", "-k", "cuda")
# The routed experts' FP8 kernel (cc/common/fp8_grouped.cu, in every module) alone, both tiles.
FP8_GROUPED_CUDA = ("parity/test_fp8_linear.py", "-k", "experts_fp8_kernel")
# The activations' quantisation for them, bit for bit.
FP8_QUANTIZE_CUDA = ("parity/test_fp8_linear.py", "-k", "activations_quantisation")
FP8_DEQUANTIZE_CUDA = ("parity/test_fp8_linear.py", "-k", "dequantisation_on_cuda")
# Its products on FP8 tensor cores: the experts both ways and a dense map's backward.
FP8_E4M3_CUDA = ("parity/test_fp8_linear.py", "-k", "fp8_tensor_cores")
# The delta rule's kernels on planes (bf16 at Qwen3.5's widths): the output and every gradient along each
# path (judge's bf16 bound passed the output 8.9% off), then judged whole: the default (on Hopper the
# recurrence, output and local_grads on wgmma), then V4TRAIN_GDR_VARIANTS=none (the warps' kernels, whole and
# along each path).
PLANES_CUDA = tuple(f"parity/test_gated_delta_rule.py::{test}" for test in (
    "test_each_path_of_the_output_and_gradients[cuda-bfloat16]", "test_the_planes_kernels_pass_the_judge_on_cuda",
    "test_the_planes_kernels_pass_the_judge_on_cuda_with_the_warps_kernels"))


def parity(op: str, *extra: str) -> tuple[str, ...]:
    """The op's own parity target, as `tools/bazel test //parity:<op>` runs it."""
    special = os.path.join("parity", f"test_{op}.py")
    files = ["parity/test_ops.py"] + ([special] if os.path.exists(os.path.join(ROOT, special)) else [])
    return (*files, f"--op=v4_{op}", *extra)


MUTATIONS = (
    Mutation("rms_norm_backward_projection", "backward only: the norm's backward drops the projection on x",
             "cc/ops/rms_norm.cc", "dx = gs.sub_(xhat.mul_(dot)).mul_(rstd)", "dx = gs.mul_(rstd)", parity("rms_norm")),
    Mutation("rms_norm_backward_eps", "backward only: the norm's backward recomputes rstd without eps",
             "cc/ops/rms_norm.cc", "const at::Tensor& rstd = saved[2];",
             "const at::Tensor rstd = at::rsqrt(compute_copy(x, v4::compute_dtype(x.scalar_type())).square()"
             ".mean(-1, true));", parity("rms_norm")),
    Mutation("cross_entropy_gradient_normalizer", "gradients only: the loss gradient not divided by the normalizer",
             "cc/ops/cross_entropy_loss.cc", "valid.unsqueeze(1).to(at::kFloat) / normalizer;",
             "valid.unsqueeze(1).to(at::kFloat);", parity("cross_entropy_loss")),
    Mutation("cross_entropy_weight_gradient_unscaled", "the LM head's gradient not scaled by the loss's incoming "
             "gradient", "cc/ops/cross_entropy_loss.cc", "if (grad_w.defined()) grad_w.mul_(scale);", "",
             parity("cross_entropy_loss")),
    Mutation("adam_stand_ins_not_written_back", "AdamW updates float32 stand-ins of non-contiguous or bf16 "
             "tensors and never writes them back", "cc/ops/adam_step.cc",
             "for (auto& [target, stand_in] : w.write_back) target.copy_(stand_in);", "", parity("adam_step")),
    Mutation("moe_slot_off_by_one", "an off-by-one in the experts' row offsets (each expert's rows start one late)",
             "cc/common/experts.cc", "const at::Tensor start = d.offsets.to(at::kLong) - d.counts;",
             "const at::Tensor start = d.offsets.to(at::kLong) - d.counts + 1;", parity("glm5_moe")),
    Mutation("combine_backward_unweighted", "backward only: the MoE combine's y gradient without its routing "
             "weight", "cc/common/experts.cc", "dy_rows.mul_(w.reshape(-1).index_select(0, order).unsqueeze(-1));", "",
             parity("glm5_moe")),
    Mutation("combine_backward_other_slot", "backward only: the routing weights' gradient summed over another "
             "token's rows (the gather's index off by one slot)", "cc/common/experts.cc",
             "y_rows.index_select(0, inverse.slice(0, t * k, (t + n) * k)).view({n, k, H});\n      dw",
             "y_rows.index_select(0, inverse.roll(1).slice(0, t * k, (t + n) * k)).view({n, k, H});\n      dw",
             parity("qwen3_5_moe")),
    Mutation("conv_document_boundary", "an off-by-one at a document boundary of cu_seqlens (a tap reaches the "
             "previous document)", "cc/ops/causal_conv1d.cc", "for (int64_t t = start + j; t < end; ++t)",
             "for (int64_t t = start + (j > 0 ? j - 1 : 0); t < end; ++t)", parity("causal_conv1d")),
    Mutation("delta_rule_decay_twice", "the decay applied once too often at a chunk boundary",
             "cc/ops/gated_delta_rule.cc", "s.mul_(r.decay.slice(0, from, to).view({n, H, 1, 1}));",
             "s.mul_(r.decay.slice(0, from, to).view({n, H, 1, 1}).square());", parity("gated_delta_rule")),
    Mutation("delta_rule_backward_state_gradient", "backward only: the reverse recurrence drops the state's own "
             "gradient (dh)", "cc/ops/gated_delta_rule.cc", "Recurrence r{dv, k_out, w, dh, decay, 1.0, -1.0, true};",
             "Recurrence r{dv, k_out, w, at::Tensor(), decay, 1.0, -1.0, true};", parity("gated_delta_rule")),
    Mutation("delta_rule_backward_decay_gradient", "backward only: the chunk decay's gradient dropped (g's gradient "
             "wrong alone, fla issue 640's kind)", "cc/ops/gated_delta_rule.cc", "(h * next).sum({-1, -2}),",
             "at::zeros_like(decay),", parity("gated_delta_rule")),
    Mutation("delta_rule_chunk_decay_one_percent_off", "backward only: the chunk decay's gradient 1% large (g's "
             "gradient some 0.6% off: inside judge's bf16 bound, caught along its path by judge_path)",
             "cc/ops/gated_delta_rule.cc", "(h * next).sum({-1, -2}),", "(h * next).sum({-1, -2}) * 1.01,",
             parity("gated_delta_rule")),
    Mutation("decay_matrix_backward_column", "backward only: the decay matrix's gradient misses the column sums",
             "cc/ops/gated_delta_rule.cc", "return {m.sum(-1, false, at::kDouble) - m.sum(-2, false, at::kDouble), at::Tensor()};",
             "return {m.sum(-1, false, at::kDouble), at::Tensor()};", parity("gated_delta_rule")),
    Mutation("latent_backward_softmax_scale", "backward only: the latent sparse attention's backward drops the "
             "softmax scale (survived the judge's old exit)", "cc/models/glm5/mla_dsa_attention.cc",
             "const at::Tensor ds = (p * (dp - (p * dp).sum(-1, true)) * scale).to(q.scalar_type());",
             "const at::Tensor ds = (p * (dp - (p * dp).sum(-1, true))).to(q.scalar_type());",
             parity("mla_dsa_attention")),
    Mutation("blocked_selection_causal_mask", "the blocked DSA selection lets a query select itself out: its "
             "causal mask off by one", "cc/models/glm5/mla_dsa_attention.cc",
             "index_scores = index_scores.masked_fill(key.unsqueeze(0) > query.unsqueeze(1),",
             "index_scores = index_scores.masked_fill(key.unsqueeze(0) >= query.unsqueeze(1),",
             parity("mla_dsa_attention")),
    Mutation("router_second_best", "the router sends every third token to its next-best expert instead of its best",
             "cc/models/qwen3_5/qwen3_5_moe.cc", "std::tie(route_weights, idx) = at::topk(probs, top_k, -1);",
             "idx = std::get<1>(at::topk(probs - (probs == std::get<0>(probs.max(-1, true))).to(probs.scalar_type()) * "
             "(at::arange(probs.size(0), probs.options()).remainder(3) == 0).unsqueeze(-1).to(probs.scalar_type()), "
             "top_k, -1)); route_weights = probs.gather(1, idx);",
             parity("qwen3_5_layer_forward", "parity/test_ties.py")),
    Mutation("recompute_redraws_dropout", "the checkpointed recomputation draws new dropout masks",
             "cc/common/checkpoint.cc", "      gen.set_state(call->rng_state);\n", "",
             parity("qwen3_5_layer_forward")),
    Mutation("recompute_reroutes_glm5", "GLM-5's checkpointed recomputation routes again",
             "cc/models/glm5/glm5_layer_forward.cc",
             "const std::optional<at::Tensor> routing = given.defined() ? std::optional<at::Tensor>(given) : std::nullopt;",
             "const std::optional<at::Tensor> routing = std::nullopt;", parity("glm5_layer_forward")),
    Mutation("recompute_reselects_glm5", "GLM-5's checkpointed recomputation selects its DSA keys again",
             "cc/models/glm5/glm5_layer_forward.cc", "if (!shared && selection.defined()) given = selection;", "",
             parity("glm5_layer_forward")),
    Mutation("recompute_reroutes_qwen", "Qwen3.5's checkpointed recomputation routes again",
             "cc/models/qwen3_5/qwen3_5_layer_forward.cc",
             "const std::optional<at::Tensor> routing = given.defined() ? std::optional<at::Tensor>(given) : std::nullopt;",
             "const std::optional<at::Tensor> routing = std::nullopt;", parity("qwen3_5_layer_forward")),
    Mutation("blocks_drop_input_gradient", "a checkpointed layer's MoE blocks leave their input's gradient out",
             "cc/common/checkpoint.cc", "if (g[0].defined()) dh.narrow(0, start, n).copy_(g[0]);", "",
             parity("qwen3_5_layer_forward")),
    Mutation("blocks_keep_last_weight_gradient", "a checkpointed layer's MoE weight gradients from its last block only",
             "cc/common/checkpoint.cc", "weight_grads[j] = weight_grads[j].defined() ? weight_grads[j] + g[j] : g[j];",
             "weight_grads[j] = g[j];", parity("glm5_layer_forward")),
    Mutation("fp8_scale_blocks_transposed", "an FP8 weight's block scales laid out transposed (row blocks by column)",
             "cc/common/lora.cc", "scale.to(compute).repeat_interleave(kFp8Block, -2)",
             "scale.to(compute).transpose(-1, -2).contiguous().view(scale.sizes()).repeat_interleave(kFp8Block, -2)",
             parity("mlp")),
    Mutation("fp8_whole_blocks_transposed", "the same where the weight is whole 128 x 128 blocks (dequantised in place)",
             "cc/common/lora.cc", "mul_(scale.to(compute).reshape(scales))",
             "mul_(scale.to(compute).transpose(-1, -2).contiguous().view(scale.sizes()).reshape(scales))",
             ("parity/test_mlp.py",)),
    Mutation("fp8_linear_keeps_a_dense_copy", "an FP8 map through at::linear of its dequantised weight (the backward "
             "keeps that copy: more memory than the weight dequantised on load)", "cc/common/lora.cc",
             "y = fp8_product(x, w, nullptr, op, name);",
             "y = at::linear(x, dense_weight(w, x.scalar_type(), op, name));", ("parity/test_mlp.py",)),
    Mutation("fp8_experts_keep_a_dense_copy", "FP8 routed experts through the grouped GEMM of their dequantised "
             "weights (its backward keeps the copy)", "cc/common/experts.cc",
             "w.weight_scale_inv ? fp8_product(x, w, &d, op, name) : grouped_linear(x, w.weight, d)",
             "grouped_linear(x, dense_weight(w, x.scalar_type(), op, name), d)", ("parity/test_mlp.py",)),
    Mutation("fp8_scale_ignored", "an FP8 weight used without its block scales",
             "cc/common/lora.cc", "return (weight.to(compute) * s).to(dtype);", "return weight.to(dtype);",
             parity("mlp")),
    Mutation("fp8_whole_blocks_unscaled", "the same where the weight is whole blocks",
             "cc/common/lora.cc", "    result.view(blocks).mul_(scale.to(compute).reshape(scales));\n", "",
             ("parity/test_mlp.py",)),
    Mutation("sparse_forward_shared_p_unrescaled", "the warp-specialised forward: warpgroup 0 shares its P at its "
             "own block's max, not rescaled to the next block's", "cc/models/glm5/mla_dsa_attention.cu",
             "p[i] = pack2<T>(s[2 * i] * factor[i % 2], s[2 * i + 1] * factor[i % 2]);",
             "p[i] = pack2<T>(s[2 * i], s[2 * i + 1]);", SPARSE_CUDA, cuda=True),
    Mutation("sparse_forward_other_block_own_buffer", "the forward's product over the other warpgroup's block "
             "reads its own key buffer", "cc/models/glm5/mla_dsa_attention.cu",
             "wgmma::desc128(other + wg * 4 * 8192 + kk * 2048, 8192, 1024));",
             "wgmma::desc128(own + wg * 4 * 8192 + kk * 2048, 8192, 1024));", SPARSE_CUDA, cuda=True),
    Mutation("sparse_forward_unused_slots_attended", "the forward's scores of slots past K (zero rows) not masked",
             "cc/models/glm5/mla_dsa_attention.cu",
             "s[4 * j + e] = ok[8 * j + 2 * tq + (e & 1)] ? s[4 * j + e] * sl2 : kNegInf;",
             "s[4 * j + e] = s[4 * j + e] * sl2;", SPARSE_CUDA, cuda=True),
    Mutation("sparse_gather_unswizzled", "the gather writes a row's chunks in order, without the 128-byte swizzle "
             "the products read", "cc/models/glm5/mla_dsa_attention.cu",
             "wgmma::sw128_offset<64>(Threads / 8 * i + p / 8, 8 * chunk);",
             "(Threads / 8 * i + p / 8) * 128 + chunk * 16;", SPARSE_CUDA, cuda=True),
    Mutation("sparse_backward_dq_rope_same_half", "backward only: both warpgroups' dq over the same 32 rope "
             "columns (the 64-byte offset into the swizzled rows dropped)", "cc/models/glm5/mla_dsa_attention.cu",
             "wgmma::desc128(k_addr + 8 * 8192 + 64 * wg + kk * 2048, 8192, 1024)",
             "wgmma::desc128(k_addr + 8 * 8192 + kk * 2048, 8192, 1024)", SPARSE_CUDA, cuda=True),
    Mutation("sparse_backward_dkv_chunk", "backward only: dkv's value chunks of the second warpgroup from the "
             "first's query columns", "cc/models/glm5/mla_dsa_attention.cu",
             "wgmma::desc128(q_addr + c * 8192 + kk * 2048, 8192, 1024)",
             "wgmma::desc128(q_addr + 2 * cc * 8192 + kk * 2048, 8192, 1024)", SPARSE_CUDA, cuda=True),
    Mutation("sparse_delta_half_the_terms", "backward only: delta = rowsum(dout * o) from every other column",
             "cc/models/glm5/mla_dsa_attention.cu", "sum += u.x * v.x + u.y * v.y;", "sum += 2.0f * u.x * v.x;",
             SPARSE_CUDA, cuda=True),
    Mutation("delta_rule_gamma_gradient_dropped", "backward only: the chunk decay's gradient through the state "
             "(dgamma) left out of g's gradient (g's alone wrong, fla issue 640's kind)", "cc/ops/gated_delta_rule.cu",
             "      v += static_cast<double>(p.dgamma[head]) * s.gamma;\n", "", DELTA_RULE_CUDA, cuda=True),
    Mutation("delta_rule_growth_unrefused_on_cuda", "a growth (g > 0) on CUDA goes unrefused: the check deferred "
             "past the kernels is never read", "cc/ops/gated_delta_rule.cc",
             "  if (growth.deferred()) refuse_growth();", "",
             ("parity/test_gated_delta_rule.py", "-k", "growth and cuda"), cuda=True),
    Mutation("delta_rule_planes_chunk_decay_one_percent_off", "backward only: the bf16 kernels' chunk decay "
             "gradient (dqkwg's dot of h and d_state) 1% large: g's gradient some 0.6% off, inside judge's bf16 "
             "bound, caught along its path by judge_path", "cc/ops/gated_delta_rule.cu",
             "const float dgamma = block_sum(state_dot<DimsT>(m.H, m.S), m.scratch);",
             "const float dgamma = 1.01f * block_sum(state_dot<DimsT>(m.H, m.S), m.scratch);",
             DELTA_RULE_CUDA, cuda=True),
    Mutation("delta_rule_beta_gradient_through_a", "backward only: beta's gradient through A = beta (K K^T * L) "
             "dropped (beta's alone wrong)", "cc/ops/gated_delta_rule.cu",
             "p.dbeta[tok * p.hv + h] = sv + s.E[i] * sk + sa;", "p.dbeta[tok * p.hv + h] = sv + s.E[i] * sk;",
             DELTA_RULE_CUDA, cuda=True),
    Mutation("delta_rule_planes_untransposed", "the recurrence's second product reads b with ldmatrix "
             "untransposed (b, not b^T; the backward's eq too)", "cc/ops/gated_delta_rule.cu",
             "ldsm_x4_t(fa, A + (k0 + lane % 8 + lane / 16 * 8) * kLda",
             "ldsm_x4(fa, A + (k0 + lane % 8 + lane / 16 * 8) * kLda",
             DELTA_RULE_CUDA, cuda=True),
    Mutation("delta_rule_dqkwg_untransposed", "dqkwg's dk_tilde product takes d_state as stored (v_new "
             "d_state, not v_new d_state^T)", "cc/ops/gated_delta_rule.cu",
             "plane_gemm<4, false, true, true, true>(m.v, kPlaneRow, 0, m.S,",
             "plane_gemm<4, false, false, true, true>(m.v, kPlaneRow, 0, m.S,",
             DELTA_RULE_CUDA, cuda=True),
    Mutation("delta_rule_local_planes_lo_offset", "[P | E Q]'s lo plane (P's read by local_grads and output) placed "
             "at the d_o planes' offset (64 x 136) instead of its own (64 x 200)", "cc/ops/gated_delta_rule.cu",
             "store_split2(planes + r * ldqp + c, kRows * ldqp, v[u].x, v[u].y);",
             "store_split2(planes + r * ldqp + c, kRows * kPlaneRow, v[u].x, v[u].y);", DELTA_RULE_CUDA, cuda=True),
    Mutation("delta_rule_key_heads_one_share", "q's and k's gradients summed over a key head's value heads take "
             "the first value head's share only", "cc/ops/gated_delta_rule.cu", "for (int j = 1; j < r; ++j) {",
             "for (int j = 1; j < 1; ++j) {", DELTA_RULE_CUDA, cuda=True),
    Mutation("delta_rule_dqkwg_rk_by_row", "dqkwg: dPL's planes for q's gradient scaled by "
             "the row's key norm (r_k of i) instead of the column's (of j)", "cc/ops/gated_delta_rule.cu",
             "x.x * rk[c], x.y * rk[c + 1]);", "x.x * rk[r], x.y * rk[r]);", DELTA_RULE_CUDA, cuda=True),
    Mutation("delta_rule_wy_prepared_ai_transposed", "backward only: prepare's recomputation hands wy_grads Ai^T "
             "for Ai (each column written as a row)", "cc/ops/gated_delta_rule.cu",
             "p.ai[(base + i) * kRows + tid] = e[i];", "p.ai[(base + tid) * kRows + i] = e[i];", DELTA_RULE_CUDA,
             cuda=True),
    Mutation("delta_rule_qp_raw_rk_by_row", "[P | E Q]'s Q K^T from the raw rows (output and local_grads): k's norm "
             "taken from the row (of i) instead of the column (of j)", "cc/ops/gated_delta_rule.cu",
             "p.scale * rn[kRows + c]", "p.scale * rn[kRows + r]", DELTA_RULE_CUDA, cuda=True),
    Mutation("delta_rule_wy_dk_rk_by_row", "wy_grads on planes: k's gradient through K K^T with (C + C^T) "
             "scaled by the row's key norm (r_k of i) instead of the column's (of j)", "cc/ops/gated_delta_rule.cu",
             "__float2bfloat16_rn(c * m.rk[j]);", "__float2bfloat16_rn(c * m.rk[i]);", PLANES_CUDA, cuda=True),
    Mutation("delta_rule_triangle_skips_diagonal", "the products through a zero triangle (Ai^T, P^T, dPL^T) skip the "
             "k-steps of a row tile's diagonal block too (kUpperA: k below m0 + 16 taken for zero)",
             "cc/ops/gated_delta_rule.cu",
             "((kTri & Tri::kUpperA) && k1 <= m0 && m0 < kRows)",
             "((kTri & Tri::kUpperA) && k1 <= m0 + 16 && m0 < kRows)", DELTA_RULE_CUDA, cuda=True),
    Mutation("delta_rule_output_planes_h_rows", "the output's h (rounded to bf16) loaded over v_new's rows (offset 0, "
             "not 64; the second pass's: the first's is copied before load_info)",
             "cc/ops/gated_delta_rule.cu", "if (c0 > 0) copy_rows<kOutCols>(x + kRows * kPitch, kPitch,",
             "if (c0 > 0) copy_rows<kOutCols>(x, kPitch,", DELTA_RULE_CUDA, cuda=True),
    Mutation("delta_rule_output_planes_early_h_columns", "the output on planes: the first pass's h, copied before "
             "load_info, taken from the second pass's columns", "cc/ops/gated_delta_rule.cu",
             "h_in + head * DimsT::dk * DimsT::dv, DimsT::dv,",
             "h_in + head * DimsT::dk * DimsT::dv + kOutCols, DimsT::dv,", PLANES_CUDA, cuda=True),
    Mutation("delta_rule_local_planes_early_d_o_over_k", "local_grads on planes: d_o's rows, copied before "
             "load_info, placed over k's (both in flight until Q K^T)", "cc/ops/gated_delta_rule.cu",
             "static constexpr int kDo = 2 * kRows * kPlaneRow;", "static constexpr int kDo = kRows * kPlaneRow;",
             PLANES_CUDA, cuda=True),
    Mutation("delta_rule_local_planes_padding_copied", "local_grads on planes: the early copies' padding slots "
             "(token >= T) take token 0's row instead of the zero fill", "cc/ops/gated_delta_rule.cu",
             '"r"(valid ? 16 : 0)', '"r"(16)', PLANES_CUDA, cuda=True),
    Mutation("delta_rule_wy_planes_c_upper_dropped", "wy_grads on planes: each row's (C + C^T) takes C^T's entries "
             "from its own row of dM (zeros above the diagonal), not from dM's column", "cc/ops/gated_delta_rule.cu",
             "const float dab = below ? dm : dM[j * kPitch64 + i];",
             "const float dab = below ? dm : dM[i * kPitch64 + j];",
             PLANES_CUDA, cuda=True),
    Mutation("delta_rule_wy_planes_keys_unscaled", "wy_grads on planes: Y's key columns without r_k (dw k^T taken "
             "as dw K^T)", "cc/ops/gated_delta_rule.cu", "val * s.beta[c] * s.E[c] * m.rk[c]",
             "val * s.beta[c] * s.E[c]", PLANES_CUDA, cuda=True),
    Mutation("delta_rule_recurrence_h_pairs_swapped", "the recurrence on planes: the odd lane of a pair writes "
             "its state's columns in the wrong order (its own pair first)", "cc/ops/gated_delta_rule.cu",
             "odd ? make_uint2(got, p1) : make_uint2(p0, got);", "odd ? make_uint2(p1, got) : make_uint2(p0, got);",
             PLANES_CUDA, cuda=True),
    Mutation("delta_rule_recurrence_base_row_kept", "the recurrence on planes: the base's second row (x0 + g + 8) "
             "handed over as the first's", "cc/ops/gated_delta_rule.cu", "base[1] = widen(next_base[1]);",
             "base[1] = widen(next_base[0]);", PLANES_CUDA, cuda=True),
    Mutation("delta_rule_recurrence_base_a_step_late", "the recurrence on planes: the base handed over after the "
             "next chunk's load (each step takes the next chunk's base)", "cc/ops/gated_delta_rule.cu",
             "    turn();\n    if (i + 1 < chunks) load(1 - stage, next);",
             "    if (i + 1 < chunks) load(1 - stage, next);\n    turn();", PLANES_CUDA, cuda=True),
    Mutation("delta_rule_prepare_planes_kk_rk_by_row", "prepare on planes: A's K K^T from k's raw rows scaled by "
             "the row's key norm twice (r_k of i, not of j)", "cc/ops/gated_delta_rule.cu",
             "v0 * m.rk[r] * m.rk[c] * decay(s, r, c)", "v0 * m.rk[r] * m.rk[r] * decay(s, r, c)", PLANES_CUDA,
             cuda=True),
    Mutation("delta_rule_prepare_planes_u_pairs_swapped", "prepare on planes: U's bfloat16 pairs stored with their "
             "two columns swapped", "cc/ops/gated_delta_rule.cu",
             "(rows + r) * DimsT::dv + col) =\n              pack2<__nv_bfloat16>(x0, x1);",
             "(rows + r) * DimsT::dv + col) =\n              pack2<__nv_bfloat16>(x1, x0);", PLANES_CUDA, cuda=True),
    Mutation("delta_rule_prepare_planes_mw_over_mu_lo", "prepare on planes: W's M planes start at U's lo plane "
             "(both over A and Ai's bytes), so U's lo plane is W's hi", "cc/ops/gated_delta_rule.cu",
             "    mw = mu + 2 * kRows * kPlane64;", "    mw = mu + kRows * kPlane64;", PLANES_CUDA, cuda=True),
    Mutation("delta_rule_prepare_planes_w_unscaled", "prepare on planes: W's M without r_k (W taken from k's raw "
             "rows as if normalised)", "cc/ops/gated_delta_rule.cu", "bw = s.beta[c] * s.E[c] * m.rk[c];",
             "bw = s.beta[c] * s.E[c];", PLANES_CUDA, cuda=True),
    Mutation("delta_rule_prepare_planes_ai_transposed", "backward only: prepare on planes hands wy_grads Ai^T for "
             "Ai", "cc/ops/gated_delta_rule.cu", "p.ai[(rows + i) * kRows + c] = x[r];",
             "p.ai[(rows + c) * kRows + i] = x[r];", PLANES_CUDA, cuda=True),
    Mutation("delta_rule_fold_eq_of_p", "the folded reverse recurrence: local_grads hands it P's columns for E Q's",
             "cc/ops/gated_delta_rule.cu", "*reinterpret_cast<const uint4*>(qp + r * m.ldqp + kRows + c);",
             "*reinterpret_cast<const uint4*>(qp + r * m.ldqp + c);", PLANES_CUDA, cuda=True),
    Mutation("delta_rule_fold_d_o_first_columns", "the folded reverse recurrence: every column block reads d_o's "
             "first 32 columns", "cc/ops/gated_delta_rule.cu",
             "copy16(to, p.d_o + (tok * p.heads + h) * d.dv + col0 + c);",
             "copy16(to, p.d_o + (tok * p.heads + h) * d.dv + c);", PLANES_CUDA, cuda=True),
    Mutation("delta_rule_wy_planes_y_rows_folded", "wy_grads on planes: a warp's Y tile in registers keeps rows "
             "g and g + 8 in one register", "cc/ops/gated_delta_rule.cu",
             "float& at = y[(c >> 3 & 1) * 4 + (r >> 3 & 1) * 2 + (c & 1)];",
             "float& at = y[(c >> 3 & 1) * 4 + (c & 1)];", PLANES_CUDA, cuda=True),
    Mutation("delta_rule_wy_planes_quarter_fetched_again", "wy_grads on planes: each quarter's prefetch copies "
             "the quarter in hand again (every quarter after the first takes the one before's floats)",
             "cc/ops/gated_delta_rule.cu", "if (q < 3) fetch(q + 1);", "if (q < 3) fetch(q);", PLANES_CUDA,
             cuda=True),
    Mutation("delta_rule_wy_planes_kkl_first_row", "wy_grads on planes: the row loop's prefetched KKL values are "
             "the warp's first row's for all four of its rows", "cc/ops/gated_delta_rule.cu",
             "kl[n][u] = kkl[(warp + n * kWarps) * kRows + lane + 32 * u];",
             "kl[n][u] = kkl[warp * kRows + lane + 32 * u];", PLANES_CUDA, cuda=True),
    Mutation("delta_rule_wy_planes_dk_part_row_tile", "wy_grads on planes: k's gradient's epilogue takes its "
             "prefetched dk_part pair by the row tile's parity (r >> 4) for the row's half (r >> 3): rows g + 8 "
             "of a tile take rows g's, or the reverse", "cc/ops/gated_delta_rule.cu",
             "const float2 pr = part[c >> 3 & 3][r >> 3 & 1];", "const float2 pr = part[c >> 3 & 3][r >> 4 & 1];",
             PLANES_CUDA, cuda=True),
    Mutation("delta_rule_wy_planes_warp_sums_halves_swapped", "wy_grads on planes: warp_sums keeps the half of "
             "its values that its partner keeps (each sum pairs one value's partial sums with another's)",
             "cc/ops/gated_delta_rule.cu",
             "const float keep = upper ? a[k + n / 2] : a[k], give = upper ? a[k] : a[k + n / 2];",
             "const float keep = upper ? a[k] : a[k + n / 2], give = upper ? a[k + n / 2] : a[k];",
             PLANES_CUDA, cuda=True),
    Mutation("delta_rule_wy_planes_row_sums_next_row", "wy_grads on planes: the row loop's KKL . dM sum taken "
             "from lane 8 n ^ 8 (the next row's k . dR_K) for lane 8 n ^ 4", "cc/ops/gated_delta_rule.cu",
             "sa = __shfl_xor_sync(0xffffffffu, x, 4);", "sa = __shfl_xor_sync(0xffffffffu, x, 8);", PLANES_CUDA,
             cuda=True),
    Mutation("delta_rule_wy_planes_value_sums_row", "wy_grads on planes: the value rows' V . dR_V sum of the "
             "pair's second row (lane 16) added to row i0 + 1, not i0 + 16", "cc/ops/gated_delta_rule.cu",
             "if (lane % 16 == 0) m.sv[i0 + lane / 16 * kWarps] += x;", "if (lane % 16 == 0) m.sv[i0 + lane / 16] += x;",
             PLANES_CUDA, cuda=True),
    Mutation("delta_rule_wy_planes_early_rows_first_slot", "wy_grads (and now prepare) on planes: the copies of "
             "k's and v's rows issued before load_info take the thread's first row's slot for its second (rows "
             "32.. hold rows 0..'s tokens)", "cc/ops/gated_delta_rule.cu",
             "for (int u = 0; u < kPasses; ++u) tok[u] = slots[i0 + u * (Threads / kPieces)];",
             "for (int u = 0; u < kPasses; ++u) tok[u] = slots[i0];", PLANES_CUDA, cuda=True),
    Mutation("delta_rule_wy_planes_early_ai_upper_rows", "wy_grads on planes: Ai's floats loaded before load_info "
             "take rows tid / 16 for both of a thread's quads (Ai's rows 32.. hold rows 0..'s)",
             "cc/ops/gated_delta_rule.cu",
             "ai_quads[u] = *reinterpret_cast<const float4*>(p.ai + (head * kRows + threadIdx.x / 16 + 32 * u) * kRows +",
             "ai_quads[u] = *reinterpret_cast<const float4*>(p.ai + (head * kRows + threadIdx.x / 16) * kRows +",
             PLANES_CUDA, cuda=True),
    Mutation("delta_rule_wy_planes_norm_dot_lane", "wy_grads on planes: k's norm backward broadcasts each row's "
             "dot from lane n (the batch's first row's) for lane 16 n", "cc/ops/gated_delta_rule.cu",
             "const float dot = __shfl_sync(0xffffffffu, x, 32 / kB * n), r = m.rk[i];",
             "const float dot = __shfl_sync(0xffffffffu, x, n), r = m.rk[i];", PLANES_CUDA, cuda=True),
    Mutation("delta_rule_dqkwg_early_h_for_d_state", "dqkwg: the copies issued before "
             "load_info (ChunkBlock's early) take h for d_state", "cc/ops/gated_delta_rule.cu",
             "copy_rows<128>(m.S, kPlaneRow, static_cast<const __nv_bfloat16*>(p.d_state) + kState * head",
             "copy_rows<128>(m.S, kPlaneRow, static_cast<const __nv_bfloat16*>(p.h) + kState * head", PLANES_CUDA,
             cuda=True),
    Mutation("delta_rule_dqkwg_dw_from_v_new", "dqkwg_planes_kernel: dw's product takes v_new's rows (v's hi "
             "plane) for dv_new's (Y's second half)", "cc/ops/gated_delta_rule.cu",
             "plane_gemm<4, false, true, true, true>(m.Y + kRows * kPlaneRow, kPlaneRow, 0, m.H,",
             "plane_gemm<4, false, true, true, true>(m.v, kPlaneRow, 0, m.H,", PLANES_CUDA, cuda=True),
    Mutation("delta_rule_wy_planes_dv_new_float_pitch", "wy_grads on planes: a staged bfloat16 quarter (dv_new's "
             "or dw's) read at the floats' pitch (68 elements, not 136)", "cc/ops/gated_delta_rule.cu",
             "*reinterpret_cast<const uint4*>(staged + r * 2 * kPitch64 + c);",
             "*reinterpret_cast<const uint4*>(staged + r * kPitch64 + c);", PLANES_CUDA,
             cuda=True),
    Mutation("delta_rule_dqkwg_dw_pair_swapped", "dqkwg_planes_kernel: dw's bfloat16 pairs stored with their two "
             "columns swapped", "cc/ops/gated_delta_rule.cu", "pack2<__nv_bfloat16>(-v0, -v1);",
             "pack2<__nv_bfloat16>(-v1, -v0);", PLANES_CUDA, cuda=True),
    Mutation("delta_rule_cluster_sum_first_rank", "the plane kernels' sums over a key head's value heads take the "
             "cluster's first block's share alone", "cc/ops/gated_delta_rule.cu",
             "for (int j = 1; j < ranks; ++j) {", "for (int j = 1; j < 1; ++j) {", PLANES_CUDA, cuda=True),
    Mutation("delta_rule_cluster_sum_rows_of_rank_0", "the plane kernels' sums over a key head's value heads: every "
             "block of the cluster sums rank 0's rows (the others' rows never written)", "cc/ops/gated_delta_rule.cu",
             "for (int i = rank + threadIdx.x / kQuads * ranks; i < kRows; i += kPass * ranks) {",
             "for (int i = threadIdx.x / kQuads * ranks; i < kRows; i += kPass * ranks) {", PLANES_CUDA, cuda=True),
    Mutation("delta_rule_wy_planes_value_lo_read", "wy_grads on planes: Y's product reads the quarters' lo plane "
             "(not written since they are exact bfloat16: stale bytes) as if it held their rounding",
             "cc/ops/gated_delta_rule.cu", "plane_gemm<2, false, true, true, true>(m.p,",
             "plane_gemm<2, false, true, true, false>(m.p,", PLANES_CUDA, cuda=True),
    Mutation("delta_rule_wgmma_x_unnegated", "the recurrence on wgmma: x goes into shared memory without sign_b "
             "(the backward's state gradient adds w^T dv_new where it subtracts it)", "cc/ops/gated_delta_rule.cu",
             "pack2<__nv_bfloat16>(p.sign_b * v0, p.sign_b * v1)", "pack2<__nv_bfloat16>(v0, v1)", PLANES_CUDA,
             cuda=True),
    Mutation("delta_rule_wgmma_tiles_one_stage", "the recurrence on wgmma: every chunk's a, b and eq land in the "
             "first stage (a stage still read is overwritten)", "cc/ops/gated_delta_rule.cu",
             "to += stage * kWgTile + tile_at;", "to += tile_at;", PLANES_CUDA, cuda=True),
    Mutation("delta_rule_wgmma_dv_local_pitch", "the recurrence on wgmma: the base's pairs (U's, dv_local's "
             "bfloat16) read at a pitch of 32 elements, not the copies' 40", "cc/ops/gated_delta_rule.cu",
             "widen(*reinterpret_cast<const uint32_t*>(base + r * kBasePitch + c))",
             "widen(*reinterpret_cast<const uint32_t*>(base + r * kCols + c))", PLANES_CUDA, cuda=True),
    Mutation("delta_rule_local_planes_dv_local_pairs_swapped", "local_grads on planes: dv_local's bfloat16 pairs "
             "stored with their two columns swapped", "cc/ops/gated_delta_rule.cu",
             "            pack2<__nv_bfloat16>(v0, v1);\n      });", "            pack2<__nv_bfloat16>(v1, v0);\n      });",
             PLANES_CUDA, cuda=True),
    Mutation("delta_rule_wgmma_decay_next_stage", "the recurrence on wgmma: a step takes the next stage's chunk "
             "decay", "cc/ops/gated_delta_rule.cu", "const float dec = m.decay[stage];",
             "const float dec = m.decay[(stage + 1) % kStages];", PLANES_CUDA, cuda=True),
    Mutation("delta_rule_chunk_wgmma_diagonal_dropped", "the output and local_grads on wgmma: P's "
             "diagonal left out (a token's own key and value)", "cc/ops/gated_delta_rule.cu",
             "return c <= r ? x * rn[r] * scale", "return c < r ? x * rn[r] * scale", PLANES_CUDA, cuda=True),
    Mutation("delta_rule_output_wgmma_h_lead", "the output on wgmma: h's descriptor takes v_new's "
             "distance between 64-column blocks (o's columns 64.. from h's rows 64.. of its first block)",
             "cc/ops/gated_delta_rule.cu", "h_desc = wgmma::desc128(wgmma::saddr(h), DimsT::dk * 128, 1024);",
             "h_desc = wgmma::desc128(wgmma::saddr(h), kRows * 128, 1024);", PLANES_CUDA, cuda=True),
    Mutation("delta_rule_chunk_wgmma_p_fragment_swapped", "the output and local_grads on wgmma: P's (P^T's) "
             "hi plane in the A fragment with registers 1 and 2 swapped (row + 8's columns for column + 8's)",
             "cc/ops/gated_delta_rule.cu", "hi[j / 2][half + 2 * (j % 2)] = h;", "hi[j / 2][2 * half + j % 2] = h;",
             PLANES_CUDA, cuda=True),
    Mutation("delta_rule_chunk_wgmma_eq_undecayed", "the output and local_grads on wgmma: E Q without E "
             "(q's decay to the chunk's start)", "cc/ops/gated_delta_rule.cu", "return x * rn[r] * scale * s.E[r];",
             "return x * rn[r] * scale;", PLANES_CUDA, cuda=True),
    Mutation("delta_rule_local_wgmma_p_untransposed", "local_grads on wgmma: Q K^T's accumulator (P) "
             "where K Q^T's (P^T) belongs", "cc/ops/gated_delta_rule.cu", "wg_gram_after_copies<1>(kq, m.k, m.q,",
             "wg_gram_after_copies<1>(kq, m.q, m.k,", PLANES_CUDA, cuda=True),
    Mutation("delta_rule_local_wgmma_eq_pairs_swapped", "local_grads on wgmma: E Q's bfloat16 pairs written with their "
             "two columns swapped (in wg_map_rows)", "cc/ops/gated_delta_rule.cu",
             "w[i] = pack2<__nv_bfloat16>(f(r, x.x), f(r, x.y));", "w[i] = pack2<__nv_bfloat16>(f(r, x.y), f(r, x.x));",
             PLANES_CUDA, cuda=True),
    Mutation("delta_rule_local_wgmma_d_o_of_key_head", "local_grads on wgmma: d_o's rows of the key head "
             "(blockIdx.y / rep) for the value head's", "cc/ops/gated_delta_rule.cu",
             "wg_rows_by_slot(m.extra, static_cast<const __nv_bfloat16*>(p.d_o), p.hv, blockIdx.y, p);",
             "wg_rows_by_slot(m.extra, static_cast<const __nv_bfloat16*>(p.d_o), p.hv, blockIdx.y / (p.hv / p.hk), p);",
             PLANES_CUDA, cuda=True),
    Mutation("delta_rule_wgmma_h_out_half", "the recurrence on wgmma: the state out's rows 64.. written over rows "
             "0.. (h's second half never written)", "cc/ops/gated_delta_rule.cu",
             "*reinterpret_cast<uint4*>(h_out + 32 * DimsT::dv * u)", "*reinterpret_cast<uint4*>(h_out + 32 * DimsT::dv * (u % 2))",
             PLANES_CUDA, cuda=True),
    Mutation("delta_rule_wgmma_fold_first_half", "the folded recurrence on wgmma: both halves of the state's "
             "rows take eq's first 64 columns", "cc/ops/gated_delta_rule.cu", "wgmma::desc_add(eq_desc, at)",
             "wgmma::desc_add(eq_desc, at - half * kRows * 128)", PLANES_CUDA, cuda=True),
    Mutation("delta_rule_dqkwg_kt_from_dq_state", "dqkwg_planes_kernel: G's term through Kt takes dq_state's row "
             "for dk_tilde's (the two float32 tiles confused)", "cc/ops/gated_delta_rule.cu",
             "p.scale, m.DQ, m.DKT, kLdF, s);", "p.scale, m.DQ, m.DQ, kLdF, s);",
             PLANES_CUDA, cuda=True),
    Mutation("delta_rule_dqkwg_v_new_pitch", "dqkwg_planes_kernel: v_new's bfloat16 rows copied into v's hi "
             "plane at their own pitch (128), not the plane's (136)", "cc/ops/gated_delta_rule.cu",
             "copy_rows<DimsT::dv>(m.v, kPlaneRow, static_cast<const __nv_bfloat16*>(p.v_new)",
             "copy_rows<DimsT::dv>(m.v, DimsT::dv, static_cast<const __nv_bfloat16*>(p.v_new)", PLANES_CUDA,
             cuda=True),
    Mutation("delta_rule_output_planes_v_new_first_columns", "output_planes_kernel: each pass copies v_new's "
             "first 64 columns", "cc/ops/gated_delta_rule.cu",
             "static_cast<const __nv_bfloat16*>(p.v_new) + head * kRows * d.dv + c0, d.dv, kRows);",
             "static_cast<const __nv_bfloat16*>(p.v_new) + head * kRows * d.dv, d.dv, kRows);", PLANES_CUDA, cuda=True),
    Mutation("fp8_quantize_quarter_warp_amax", "quantize_rows takes each block's amax over a quarter-warp's 64 "
             "columns (the shuffles from offset 4)", "cc/common/fp8.cu",
             "for (int offset = 8; offset > 0; offset /= 2) amax = fmaxf(amax,",
             "for (int offset = 4; offset > 0; offset /= 2) amax = fmaxf(amax,", FP8_QUANTIZE_CUDA, cuda=True,
             module="v4_linear_test"),
    Mutation("fp8_advance_carry_dropped", "the FP8 loops' places step past a row's end without moving to the next "
             "row (quantize_rows' pairs of blocks, the dequantisation's vectors)", "cc/common/fp8.cu",
             "  major += d_major + carry;", "  major += d_major;", FP8_QUANTIZE_CUDA, cuda=True,
             module="v4_linear_test"),
    Mutation("fp8_dequantize_matrix_carry_dropped", "the dequantisation's threads step past a matrix's last row "
             "without moving to the next matrix", "cc/common/fp8.cu", "    advance(m, r, step_m, 0, rows);",
             "    m += step_m;", FP8_DEQUANTIZE_CUDA, cuda=True, module="v4_linear_test"),
    Mutation("fp8_grouped_one_scale_a_tile", "the experts' FP8 kernel scales both halves of a column tile by its "
             "first half's block", "cc/common/fp8_grouped.cu", "f.s[h] = __ldg(ss + h * s_half);",
             "f.s[h] = __ldg(ss);", FP8_GROUPED_CUDA, cuda=True, module="v4_linear_test"),
    Mutation("fp8_grouped_x_rows_shifted", "the experts' FP8 kernel has x's tile copied one row late (TMA at row "
             "first + 1)", "cc/common/fp8_grouped.cu", "step * kBK, c.tile.first, full + slot);",
             "step * kBK, c.tile.first + 1, full + slot);", FP8_GROUPED_CUDA, cuda=True, module="v4_linear_test"),
    Mutation("fp8_grouped_backward_read_k_major", "backward only: the experts' FP8 kernel reads the weight's tile "
             "K-major where it lies MN-major (W^T's tile for W's)", "cc/common/fp8_grouped.cu",
             "wgmma::mma<__nv_bfloat16, BN, 0, Transposed ? 1 : 0>(",
             "wgmma::mma<__nv_bfloat16, BN, 0, 0>(", FP8_GROUPED_CUDA,
             cuda=True, module="v4_linear_test"),
    Mutation("fp8_grouped_tall_rows_once", "the experts' FP8 kernel, 256-row tile: each warpgroup's second "
             "product reads its first's 64 rows of x", "cc/common/fp8_grouped.cu", "wgmma::desc128(x_tile + u * 8192 +",
             "wgmma::desc128(x_tile +", FP8_GROUPED_CUDA, cuda=True, module="v4_linear_test"),
    Mutation("fp8_grouped_epilogue_rows_unpadded", "the experts' FP8 kernel copies its staged rows out at 128 bytes a "
             "row where they lie 144 apart", "cc/common/fp8_grouped.cu",
             "stage + r * kEpiloguePitch + lane % 8 * 16", "stage + r * 128 + lane % 8 * 16", FP8_GROUPED_CUDA,
             cuda=True, module="v4_linear_test"),
    Mutation("fp8_e4m3_weight_scale_first_block", "the experts' kernel on FP8 tensor cores promotes every block of "
             "the sum with the weight's first block's scale", "cc/common/fp8_grouped.cu",
             "__ldg(c.w + step * w_step + h * blocks_in)", "__ldg(c.w + h * blocks_in)", FP8_E4M3_CUDA, cuda=True,
             module="v4_linear_test"),
    Mutation("fp8_e4m3_row_scale_upper_half", "the experts' kernel on FP8 tensor cores scales a fragment's rows 8-15 "
             "by rows 0-7's scales", "cc/common/fp8_grouped.cu", "x1 = __ldg(c.x1 + int64_t(step) * a.padded);",
             "x1 = __ldg(c.x0 + int64_t(step) * a.padded);", FP8_E4M3_CUDA, cuda=True, module="v4_linear_test"),
    Mutation("fp8_e4m3_sums_unpromoted", "the experts' kernel on FP8 tensor cores carries the tensor cores' sum "
             "from block to block (never restarted after a promotion)", "cc/common/fp8_grouped.cu", "kk > 0);",
             "true);", FP8_E4M3_CUDA, cuda=True, module="v4_linear_test"),
    Mutation("fp8_e4m3_transpose_unswizzled", "backward only: the transposed weight tile is stored without the "
             "128-byte swizzle its product reads", "cc/common/fp8_grouped.cu",
             "tile + n * 128 + ((kb / 4) ^ (n % 8)) * 16 + kb % 4 * 4", "tile + n * 128 + kb / 4 * 16 + kb % 4 * 4",
             FP8_E4M3_CUDA, cuda=True, module="v4_linear_test"),
    Mutation("fp8_grouped_ahead_slot_reused", "the experts' FP8 kernel loads a step's weights into the registers of "
             "one not yet converted", "cc/common/fp8_grouped.cu", "fetch(f[(j + kAhead - 1) % kAhead], load);",
             "fetch(f[(j + kAhead - 2) % kAhead], load);", FP8_GROUPED_CUDA, cuda=True, module="v4_linear_test"),
    Mutation("fp8_registers_rows_below", "the experts' FP8 forward (fp8_registers_kernel): each A fragment's rows "
             "+8 read from the first 8", "cc/common/fp8_grouped.cu",
             "constexpr int frag[4] = {0, 8 * kBK, 8, 8 * kBK + 8};", "constexpr int frag[4] = {0, 0, 8, 8};",
             FP8_GROUPED_CUDA, cuda=True, module="v4_linear_test"),
    Mutation("fp8_registers_backward_unswizzled", "the experts' FP8 backward "
             "(fp8_registers_kernel<true>): the ldmatrix rows of the weight's tile read without TMA's 128-byte "
             "swizzle", "cc/common/fp8_grouped.cu", "(((4 * wg + warp) ^ (lane % 8)) * 16)", "((4 * wg + warp) * 16)",
             FP8_GROUPED_CUDA, cuda=True, module="v4_linear_test"),
    Mutation("fp8_grouped_last_step_dropped", "the experts' FP8 kernel leaves the last 64 of each sum out",
             "cc/common/fp8_grouped.cu", "steps = K / kBK;", "steps = K / kBK - 1;", FP8_GROUPED_CUDA, cuda=True,
             module="v4_linear_test"),
)


def build(cuda: bool = False, root: str = ROOT, only: str = "", jobs: int = 0) -> None:
    flags = ["--jobs", str(jobs or os.cpu_count() or 2)] if cuda else ["--no-cuda"]
    result = subprocess.run([sys.executable, os.path.join(root, "tools", "build_ext.py"), "--out", out_dir(root), *flags,
                             *(["--only", only] if only else [])], cwd=root, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(result.stdout[-2000:] + result.stderr[-4000:])


def out_dir(root: str) -> str:
    return os.path.join(root, "build", "mutants")


def run_tests(tests: tuple[str, ...], cuda: bool = False, root: str = ROOT) -> tuple[bool, str]:
    """(passed, the first failure's line) of pytest on `tests`, against the modules built under `root`."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(root, "py"), os.path.join(root, "py", "tests"),
                                                       out_dir(root), root]), OMP_NUM_THREADS="1")
    if cuda:
        env["V4TRAIN_HYPOTHESIS_PROFILE"] = "mutant"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                            cwd=root, capture_output=True, text=True, env=env)
    failed = [line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return result.returncode == 0, (failed[0][:300] if failed else result.stdout.strip().splitlines()[-1][:300])


def apply(m: Mutation, root: str = ROOT) -> str:
    """Writes the mutated source; returns the original text."""
    path = os.path.join(root, m.path)
    with open(path) as f:
        text = f.read()
    if text.count(m.find) != 1:
        raise ValueError(f"{m.name}: expected the text to mutate exactly once in {m.path}, found it "
                         f"{text.count(m.find)} times: {m.find!r}")
    with open(path, "w") as f:
        f.write(text.replace(m.find, m.replace))
    return text


ROOT_BUILD = os.path.join(ROOT, "build", "ext")  # tools/build_ext.py's default --out


def seed_objects(out: str, built: str, root: str) -> None:
    """Copies the objects under `out` (built from the sources at `built`) into root's build, renamed
    for root (build_ext names an object by its source's path), their times kept (copy2): the sources
    copied with their times (copytree) compile again only where they are newer than their objects."""
    old, new = (os.path.relpath(r, "/").replace("/", "_") + "_" for r in (built, root))
    for objdir in (d for d in os.listdir(out) if d.startswith("obj")):
        os.makedirs(os.path.join(out_dir(root), objdir))
        for f in os.listdir(os.path.join(out, objdir)):
            shutil.copy2(os.path.join(out, objdir, f), os.path.join(out_dir(root), objdir, f.replace(old, new, 1)))


def built_copy(m: Mutation | None, root: str, modules: str, jobs: int = 2,
               base: concurrent.futures.Future | None = None) -> str:
    """A copy of the sources at `root` with `m` applied and `modules` built there. One nvcc
    compilation of a kernel file takes minutes on one core, so the CUDA mutations are built side
    by side, each in its own copy. With `base` (the unmutated copy, built) the copy starts from its
    objects, renamed for this root (build_ext names an object by its source's path), and the mutation
    is written after them: only the mutated source (every source, for a header) compiles again. The
    unmutated copy starts from the checkout's build/ext where there is one (build_ext.py run first)."""
    for d in ("cc", "py", "parity", "tools"):
        shutil.copytree(os.path.join(ROOT, d), os.path.join(root, d), ignore=shutil.ignore_patterns("__pycache__"))
    os.symlink(os.path.join(ROOT, "testdata"), os.path.join(root, "testdata"))
    if base is not None:
        seed_objects(out_dir(base.result()), base.result(), root)
    elif os.path.isdir(ROOT_BUILD):  # the unmutated copy starts from the checkout's own build, if any
        seed_objects(ROOT_BUILD, ROOT, root)
    if m is not None:
        apply(m, root)
    build(True, root, modules, jobs=jobs)
    return root


def module_of(m: Mutation) -> str:
    """The module built for a mutation of a kernel source: the module the file is built into
    (cc/models/glm5/mla_dsa_attention.cu: v4_mla_dsa_attention), or m.module for a shared one."""
    return m.module or "v4_" + os.path.splitext(os.path.basename(m.path))[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma list of mutation names")
    parser.add_argument("--cuda", action="store_true", help="the CUDA kernels' mutations (on a machine with a GPU)")
    args = parser.parse_args()
    kind = [m for m in MUTATIONS if m.cuda == args.cuda]
    chosen = [m for m in kind if not args.only or m.name in args.only.split(",")]
    unknown = set(filter(None, args.only.split(","))) - {m.name for m in kind}
    if unknown:
        sys.exit(f"mutants: unknown {'CUDA ' if args.cuda else ''}mutation(s) {', '.join(sorted(unknown))}"
                 + ("" if args.cuda else " (the CUDA ones need --cuda)"))
    if args.cuda:
        import torch

        if not torch.cuda.is_available():  # the CUDA cases would skip, and every mutation would survive
            sys.exit("mutants: --cuda needs a GPU (torch.cuda.is_available() is False)")
    print(f"mutants: the unmutated build first, then {len(chosen)} mutation(s)", flush=True)
    survivors, unbuilt = [], []

    def report(m: Mutation, ok: bool, line: str, start: float) -> None:
        if line.startswith("did not build"):  # a mutation's own typo, no gap in the tests: said as such
            unbuilt.append(m.name)
            said = line.removeprefix("did not build: ").strip().splitlines() or ["(the build printed nothing)"]
            verdict = "DID NOT BUILD: " + next((x for x in said if "error" in x), said[-1])[:200]
        elif ok:
            survivors.append(m.name)
            verdict = "SURVIVED"
        else:
            verdict = line.removeprefix("FAILED ").split(" - ")[0]
        print(f"| {m.name} | {m.what} | {verdict} ({time.time() - start:.0f} s) |", flush=True)

    def check_unmutated(root: str) -> None:
        for tests in sorted({m.tests for m in chosen}):
            ok, line = run_tests(tests, args.cuda, root)
            if not ok:
                sys.exit(f"mutants: the unmutated sources fail {' '.join(tests)}: {line}")
        print("| mutation | what | caught by |", flush=True)
        print("|---|---|---|", flush=True)

    if args.cuda:  # each in its own copy, judged one at a time on the GPU
        start = time.time()
        cpus = os.cpu_count() or 2
        # The unmutated copy builds every chosen mutation's module on all the cores; then the mutated
        # copies, side by side, each its own module from the unmutated objects (its mutated source alone).
        with tempfile.TemporaryDirectory(prefix="v4train-mutants-") as tmp, \
                concurrent.futures.ThreadPoolExecutor(len(chosen) + 1) as pool:
            base = pool.submit(built_copy, None, os.path.join(tmp, "0"),
                               ",".join(sorted({module_of(m) for m in chosen})), cpus)
            copies = [pool.submit(built_copy, m, os.path.join(tmp, str(i + 1)), module_of(m),
                                  max(2, cpus // max(1, len(chosen))), base) for i, m in enumerate(chosen)]
            check_unmutated(base.result())
            for m, copy in zip(chosen, copies):
                try:
                    ok, line = run_tests(m.tests, True, copy.result())
                except RuntimeError as e:  # a mutation that does not compile is no test of the suite
                    ok, line = True, f"did not build: {str(e)[-300:]}"
                report(m, ok, line, start)
    else:  # in place, one at a time: the rebuild after a mutation compiles one file
        build()
        check_unmutated(ROOT)
        for m in chosen:
            start = time.time()
            original = apply(m)
            try:
                build()
                ok, line = run_tests(m.tests)
            except RuntimeError as e:
                ok, line = True, f"did not build: {str(e)[-300:]}"
            finally:
                with open(os.path.join(ROOT, m.path), "w") as f:
                    f.write(original)
            report(m, ok, line, start)
        build()  # the restored sources
    print(f"mutants: {len(chosen) - len(survivors) - len(unbuilt)} of {len(chosen)} caught"
          + (f"; survived: {', '.join(survivors)}" if survivors else "")
          + (f"; did not build (fix the mutation): {', '.join(unbuilt)}" if unbuilt else ""))
    return 1 if survivors or unbuilt else 0


if __name__ == "__main__":
    sys.exit(main())
