"""GLM-5 (glm_moe_dsa): the weight table and the family record. The layer op is v4_glm5_layer_forward."""

from __future__ import annotations

from v4train.models.glm5.config import Glm5Config
from v4train.models.weights import WeightSpec


def layer_specs(cfg: Glm5Config, i: int) -> list[WeightSpec]:
    """The tensors of layer i, named as in transformers (relative to model.layers.{i}.).

    fp32=True marks what transformers keeps in float32 (_keep_in_fp32_modules[_strict]).
    """
    H, nh = cfg.hidden_size, cfg.num_attention_heads
    S = WeightSpec
    specs = [
        S("input_layernorm.weight", (H,), "ones"),
        S("post_attention_layernorm.weight", (H,), "ones"),
        S("self_attn.q_a_proj.weight", (cfg.q_lora_rank, H)),
        S("self_attn.q_a_layernorm.weight", (cfg.q_lora_rank,), "ones"),
        S("self_attn.q_b_proj.weight", (nh * cfg.qk_head_dim, cfg.q_lora_rank)),
        S("self_attn.kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H)),
        S("self_attn.kv_a_layernorm.weight", (cfg.kv_lora_rank,), "ones"),
        S("self_attn.kv_b_proj.weight", (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)),
        S("self_attn.o_proj.weight", (H, nh * cfg.v_head_dim)),
    ]
    if cfg.indexer_types[i] == "full":
        d = cfg.index_head_dim
        specs += [
            S("self_attn.indexer.wq_b.weight", (cfg.index_n_heads * d, cfg.q_lora_rank)),
            S("self_attn.indexer.wk.weight", (d, H)),
            S("self_attn.indexer.k_norm.weight", (d,), "ones"),
            S("self_attn.indexer.k_norm.bias", (d,), "zeros"),
            S("self_attn.indexer.weights_proj.weight", (cfg.index_n_heads, H), fp32=True),
        ]
    if cfg.mlp_layer_types[i] == "dense":
        I = cfg.intermediate_size
        specs += [S("mlp.gate_proj.weight", (I, H)), S("mlp.up_proj.weight", (I, H)), S("mlp.down_proj.weight", (H, I))]
    else:
        E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
        Is = I * cfg.n_shared_experts
        specs += [
            S("mlp.gate.weight", (E, H), fp32=True),
            S("mlp.gate.e_score_correction_bias", (E,), "zeros", fp32=True),
            S("mlp.experts.gate_up_proj", (E, 2 * I, H), experts=("gate_proj", "up_proj")),
            S("mlp.experts.down_proj", (E, H, I), experts=("down_proj",)),
            S("mlp.shared_experts.gate_proj.weight", (Is, H)),
            S("mlp.shared_experts.up_proj.weight", (Is, H)),
            S("mlp.shared_experts.down_proj.weight", (H, Is)),
        ]
    return specs
