"""Writes the tiny checkpoints and golden outputs of testdata/models/ with transformers.

    tools/bazel run //tools:make_goldens       (or: python3 tools/make_goldens.py OUT_DIR)

For each case: a randomly initialised transformers model (fp32, eager attention, seed 0) is
saved as a Hugging Face checkpoint, then run on fixed token rows with labels = input_ids; its
logits, loss and the gradient of every parameter are stored beside it (golden.safetensors, golden.json). The
tests compare v4train's reference path against these numbers; transformers itself is a tool-
and test-only dependency (pinned in tools/requirements.txt) that v4train never imports.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys

import torch
from safetensors.torch import load_file, save_file

import transformers
from torch.overrides import TorchFunctionMode
from transformers import (GlmMoeDsaConfig, GlmMoeDsaForCausalLM, Qwen3_5Config, Qwen3_5ForCausalLM,
                          Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration,
                          Qwen3_5MoeTextConfig, Qwen3_5TextConfig)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "py"))  # outside Bazel
from v4train.testing.compare import rounding_spread  # noqa: E402

GLM5 = dict(vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
            topk_group=2, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=16, qk_nope_head_dim=24,
            index_topk=12, index_head_dim=32, index_n_heads=8, first_k_dense_replace=1,
            indexer_types=["full", "shared", "full", "shared"], max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, routed_scaling_factor=2.5)
GLM5_YARN = dict(GLM5, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 128, "mscale": 1.0,
                                        "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})
QWEN_TEXT = dict(vocab_size=160, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8,
                 linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=512,
                 layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
QWEN_MOE = dict(QWEN_TEXT, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=8,
                num_experts_per_tok=2)
QWEN_DENSE = dict(QWEN_TEXT, intermediate_size=96)

# name -> (builder, rows x tokens of the golden batch, save kwargs). Rows longer than index_topk
# (GLM-5) and not multiples of the DeltaNet chunk of 64 (Qwen3.5), one past 64.
CASES = {
    "glm5": (lambda: GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**GLM5)), (2, 45), {}),
    "glm5_yarn_fp8": (lambda: GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**GLM5_YARN)), (2, 45), {"fp8": True}),
    "qwen3_5_moe": (lambda: Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**QWEN_MOE)), (2, 70), {}),
    "qwen3_5_moe_sharded": (lambda: Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**QWEN_MOE)), (1, 37),
                            {"max_shard_size": "60KB"}),
    "qwen3_5_moe_vl": (lambda: Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(
        text_config=QWEN_MOE, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                 out_hidden_size=64, patch_size=4, temporal_patch_size=2))),
        (2, 33), {}),
    "qwen3_5": (lambda: Qwen3_5ForCausalLM(Qwen3_5TextConfig(**QWEN_DENSE)), (2, 70), {}),
}

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def quantize_fp8(w: torch.Tensor, block: int = 128):
    """float8_e4m3fn weight and its per-128x128-block weight_scale_inv (dequant: w * scale_inv)."""
    rows, cols = w.shape
    br, bc = -(-rows // block), -(-cols // block)
    padded = torch.zeros(br * block, bc * block)
    padded[:rows, :cols] = w
    blocks = padded.view(br, block, bc, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).view(br * block, bc * block)[:rows, :cols].to(torch.float8_e4m3fn)
    return q, scale


def write_fp8(model_dir: str) -> dict[str, torch.Tensor]:
    """Rewrites a saved GLM-5 checkpoint in FP8 (2-D projection weights, as the released one);
    returns the dequantised weights, which the golden model then runs with."""
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    out, dequant = {}, {}
    for key, t in tensors.items():
        quantizable = t.dim() == 2 and "proj" in key and "weights_proj" not in key
        if quantizable:
            q, scale = quantize_fp8(t)
            out[key], out[key + "_scale_inv"] = q, scale
            d = q.float().repeat(1, 1)
            s = scale.repeat_interleave(128, 0)[: t.shape[0]].repeat_interleave(128, 1)[:, : t.shape[1]]
            dequant[key] = d * s
        else:
            out[key] = t
    save_file(out, path, metadata={"format": "pt"})
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return dequant


def _as_float64(x):
    if x is torch.float32:
        return torch.float64
    if isinstance(x, (list, tuple)):
        return type(x)(_as_float64(i) for i in x)
    if isinstance(x, dict):
        return {k: _as_float64(v) for k, v in x.items()}
    return x


class Float64(TorchFunctionMode):
    """Runs transformers' code with every float32 it asks for (its fp32 norms, routers and
    DeltaNet rule inside a float64 model) in float64 instead: the exact answer the fp32 goldens
    are rounded approximations of."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        return func(*_as_float64(args), **_as_float64(kwargs or {}))


def float64_gradients(model, input_ids) -> dict[str, torch.Tensor]:
    """The gradients of the loss with labels = input_ids, evaluated in float64 throughout."""
    model = model.double()
    model.set_experts_implementation("eager")  # torch._grouped_mm has no float64
    model.zero_grad()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with Float64():
            model(input_ids=input_ids, labels=input_ids).loss.backward()
    finally:
        torch.set_default_dtype(default)
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def make(name: str, out_root: str) -> None:
    build, (rows, seq), opts = CASES[name]
    torch.manual_seed(0)
    model = build().float().eval()
    model.config._attn_implementation = "eager"
    # Make the zero-initialised parts matter: routing biases, zero-centred norms.
    with torch.no_grad():
        for pname, p in list(model.named_parameters()) + list(model.named_buffers()):
            if pname.endswith("e_score_correction_bias") or (name.startswith("qwen") and pname.endswith("norm.weight")):
                p.normal_(0.0, 0.1)
    out = os.path.join(out_root, name)
    shutil.rmtree(out, ignore_errors=True)
    kwargs = {"max_shard_size": opts["max_shard_size"]} if "max_shard_size" in opts else {}
    model.save_pretrained(out, **kwargs)
    if opts.get("fp8"):
        dequant = write_fp8(out)
        state = model.state_dict()
        with torch.no_grad():
            for key, t in dequant.items():
                hf_key = key
                if ".experts." in key:  # per-expert on disk, fused in memory: rebuild the fused tensor
                    continue
                state[hf_key].copy_(t)
            _copy_experts(model, dequant)
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, model.config.get_text_config().vocab_size, (rows, seq), generator=gen)
    model.train()  # dropout is 0; train() only matters for gradient checkpointing, which is off
    result = model(input_ids=input_ids, labels=input_ids)
    result.loss.backward()
    grads = {"grad." + n: p.grad.contiguous() for n, p in model.named_parameters() if p.grad is not None}
    # The exact gradients (float64, stored rounded to fp32): where fp32 rounding is large (the
    # small DeltaNet gradients), v4train must be as close to them as transformers' fp32 run is.
    grads64 = {"grad64." + n: g.float().contiguous() for n, g in float64_gradients(model, input_ids).items()}
    # How far rounding the weights and every module's output to fp32 moves each exact gradient (the
    # rounding any fp32 evaluation carries; v4train.testing.compare.assert_rel_close).
    exact = copy.deepcopy(model).double()
    spreads = {"spread." + n: torch.tensor(v, dtype=torch.float64)
               for n, v in rounding_spread(exact, lambda m: float64_gradients(m, input_ids)).items()}
    save_file({"input_ids": input_ids, "logits": result.logits.detach().contiguous(), **grads, **grads64, **spreads},
              os.path.join(out, "golden.safetensors"))
    with open(os.path.join(out, "golden.json"), "w") as f:
        json.dump({"transformers": transformers.__version__, "torch": torch.__version__, "loss": result.loss.item()},
                  f, indent=1, sort_keys=True)
    size = sum(os.path.getsize(os.path.join(out, x)) for x in os.listdir(out))
    print(f"{name}: loss {result.loss.item():.6f}, {len(grads)} grads, {size / 1024:.0f} KiB in {out}")


def _copy_experts(model, dequant):
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if not pname.endswith(("experts.gate_up_proj", "experts.down_proj")):
                continue
            prefix = pname[: pname.rindex("experts.") + len("experts.")]
            projs = ("gate_proj", "up_proj") if pname.endswith("gate_up_proj") else ("down_proj",)
            for e in range(p.shape[0]):
                parts = [dequant.get(f"{prefix}{e}.{proj}.weight") for proj in projs]
                if all(x is not None for x in parts):
                    p[e].copy_(torch.cat(parts, dim=0))


if __name__ == "__main__":
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.environ.get("BUILD_WORKSPACE_DIRECTORY", os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        "testdata", "models")
    for case in (sys.argv[2:] or CASES):
        make(case, root)
