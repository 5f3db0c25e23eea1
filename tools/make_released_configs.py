"""Writes testdata/released/*/config.json, the released models' configs (no weights), for the
memory planner (//py:plan) and anyone asking what they need.

    tools/bazel run //tools:make_released_configs      (or: python3 tools/make_released_configs.py [OUT_DIR])

- GLM-5-FP8: transformers' GlmMoeDsaConfig() defaults, which are GLM-5's released architecture
  (78 layers, hidden 6144, 256 routed experts top-8 of 2048, DSA top-2048, vocabulary 154,880),
  with the FP8 quantization_config of the zai-org/GLM-5-FP8 release.
- Qwen3.5-397B-A17B-FP8: Qwen3_5MoeConfig (the vision-language wrapper the release ships; its
  vision_config is left out: v4train reads the text model only) with the text model's values from
  public material (testdata/released/README.md names the sources), and the FP8
  quantization_config of the Qwen/Qwen3.5-397B-A17B-FP8 release.

Which modules the FP8 releases keep in high precision is docs/models.md's table (read from public
material, not from the checkpoints): modules_to_not_convert below lists its linear modules.
"""

from __future__ import annotations

import json
import os
import sys

import transformers
from transformers import GlmMoeDsaConfig, Qwen3_5MoeConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fp8(not_converted: list[str]) -> dict:
    """transformers' fp8 quantization_config as the FP8 releases write it: e4m3 weights with a
    float32 scale per 128 x 128 block (weight_scale_inv), activations quantised on the fly."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "modules_to_not_convert": not_converted}


def glm5() -> dict:
    d = GlmMoeDsaConfig().to_dict()
    d["architectures"] = ["GlmMoeDsaForCausalLM"]
    # bf16 / fp32 in the release: embeddings, LM head, the indexer's weights_proj, the router (and
    # the MTP layer's eh_proj; norms are no linear modules).
    d["quantization_config"] = fp8(["lm_head", "model.embed_tokens", "self_attn.indexer.weights_proj", "mlp.gate",
                                    "eh_proj"])
    return d


# Qwen3.5-397B-A17B's text model: 60 layers, 15 x (3 Gated DeltaNet + 1 gated attention), hidden
# 4096; gated attention 32 query / 2 key-value heads of 256, RoPE on a quarter of each head
# (theta 10^7); Gated DeltaNet 16 key / 64 value heads of 128; 512 routed experts, 10 a token, of
# 1024, and a shared expert of 1024; vocabulary 248,320; 262,144 positions.
QWEN3_5_397B_TEXT = dict(
    hidden_size=4096, num_hidden_layers=60, full_attention_interval=4,
    num_attention_heads=32, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    num_experts=512, num_experts_per_tok=10, moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
    vocab_size=248320, max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
)


def qwen3_5_397b() -> dict:
    d = Qwen3_5MoeConfig(text_config=QWEN3_5_397B_TEXT, tie_word_embeddings=False).to_dict()
    d.pop("vision_config")
    d["architectures"] = ["Qwen3_5MoeForConditionalGeneration"]
    # bf16 in the release: embeddings, LM head, the router and the shared expert's gate, Gated
    # DeltaNet's in_proj_b and in_proj_a (its conv, A_log, dt_bias and norms are no linear
    # modules), the MTP layer and the vision tower.
    d["quantization_config"] = fp8(["lm_head", "embed_tokens", "mlp.gate", "mlp.shared_expert_gate",
                                    "linear_attn.in_proj_b", "linear_attn.in_proj_a", "mtp", "model.visual"])
    return d


CONFIGS = {"GLM-5-FP8": glm5, "Qwen3.5-397B-A17B-FP8": qwen3_5_397b}


def main(out_dir: str) -> int:
    for name, make in CONFIGS.items():
        folder = os.path.join(out_dir, name)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(make(), f, indent=2, sort_keys=True)
            f.write("\n")
        print(f"wrote {folder}/config.json (transformers {transformers.__version__})")
    return 0


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.environ.get("BUILD_WORKSPACE_DIRECTORY", ROOT), "testdata", "released")
    sys.exit(main(out))
