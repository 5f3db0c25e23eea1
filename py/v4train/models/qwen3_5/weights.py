"""Qwen3.5 / Qwen3.6 (qwen3_5_moe, qwen3_5): the weight table and the family record. The layer op
is v4_qwen3_5_layer_forward."""

from __future__ import annotations

from v4train.models.qwen3_5.config import Qwen35Config
from v4train.models.weights import WeightSpec


def layer_specs(cfg: Qwen35Config, i: int) -> list[WeightSpec]:
    """The tensors of layer i, named as in transformers (relative to model.layers.{i}.)."""
    H = cfg.hidden_size
    S = WeightSpec
    # Decoder norms are zero-centred (scale 1 + w): initialised to 0.
    specs = [S("input_layernorm.weight", (H,), "zeros"), S("post_attention_layernorm.weight", (H,), "zeros")]
    if cfg.layer_types[i] == "linear_attention":
        kd = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        vd = cfg.linear_num_value_heads * cfg.linear_value_head_dim
        nv = cfg.linear_num_value_heads
        specs += [
            S("linear_attn.in_proj_qkv.weight", (2 * kd + vd, H)),
            S("linear_attn.in_proj_z.weight", (vd, H)),
            S("linear_attn.in_proj_b.weight", (nv, H)),
            S("linear_attn.in_proj_a.weight", (nv, H)),
            S("linear_attn.conv1d.weight", (2 * kd + vd, 1, cfg.linear_conv_kernel_dim)),
            S("linear_attn.dt_bias", (nv,), "ones"),
            S("linear_attn.A_log", (nv,), "a_log"),
            S("linear_attn.norm.weight", (cfg.linear_value_head_dim,), "ones"),
            S("linear_attn.out_proj.weight", (H, vd)),
        ]
    else:
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        specs += [
            S("self_attn.q_proj.weight", (nh * hd * 2, H)),
            S("self_attn.k_proj.weight", (nkv * hd, H)),
            S("self_attn.v_proj.weight", (nkv * hd, H)),
            S("self_attn.o_proj.weight", (H, nh * hd)),
            S("self_attn.q_norm.weight", (hd,), "zeros"),
            S("self_attn.k_norm.weight", (hd,), "zeros"),
        ]
    if cfg.is_moe:
        E, I, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        specs += [
            S("mlp.gate.weight", (E, H)),
            S("mlp.experts.gate_up_proj", (E, 2 * I, H), experts=("gate_proj", "up_proj")),
            S("mlp.experts.down_proj", (E, H, I), experts=("down_proj",)),
            S("mlp.shared_expert.gate_proj.weight", (Is, H)),
            S("mlp.shared_expert.up_proj.weight", (Is, H)),
            S("mlp.shared_expert.down_proj.weight", (H, Is)),
            S("mlp.shared_expert_gate.weight", (1, H)),
        ]
    else:
        I = cfg.intermediate_size
        specs += [S("mlp.gate_proj.weight", (I, H)), S("mlp.up_proj.weight", (I, H)), S("mlp.down_proj.weight", (H, I))]
    return specs
