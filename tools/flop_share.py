"""The share of a training step's FLOPs that runs in C++ ops (v4train.flops.FlopShare), printed.

    PYTHONPATH=py:build/ext:. python3 tools/flop_share.py [--model bundled|glm5_layer|qwen3_5_moe] [--tokens N]

bundled: the GLM-5-architecture model of testdata/glm5_base, LoRA on attention and experts (what
glm5.flags trains). glm5_layer: one GLM-5 MoE decoder layer at full width (hidden 6144, 64 heads,
MLA ranks 2048/512, DSA indexer, 8 routed experts of width 2048 with top-8, which is the active
compute of the 256-expert layer, plus the shared expert), random weights, LoRA on attention and
experts, in bf16 on the CPU; its vocabulary shrunk to 1024 so that the count is the layer's.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "py"))

from v4train import hf_checkpoint, lora, ops  # noqa: E402
from v4train.flops import FlopShare  # noqa: E402
from v4train.models import config_from_dict  # noqa: E402
from v4train.model import CausalLM, Packed  # noqa: E402
from v4train.optim import AdamW  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLM5_LAYER = {"model_type": "glm_moe_dsa", "num_hidden_layers": 1, "vocab_size": 1024, "mlp_layer_types": ["sparse"],
              "indexer_types": ["full"], "n_routed_experts": 8, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1}

QWEN3_5_MOE = {"model_type": "qwen3_5_moe", "num_hidden_layers": 4, "vocab_size": 1024, "hidden_size": 512,
               "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 128,
               "shared_expert_intermediate_size": 128, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
               "linear_key_head_dim": 64, "linear_value_head_dim": 64, "num_attention_heads": 8,
               "num_key_value_heads": 2, "head_dim": 64}  # 3 Gated DeltaNet layers + 1 gated attention


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bundled", choices=["bundled", "glm5_layer", "qwen3_5_moe"])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--cpp_ops", default="all")
    args = parser.parse_args()
    if args.model == "bundled":
        model, _ = hf_checkpoint.load(os.path.join(ROOT, "testdata", "glm5_base"))
        dtype = torch.float32
    else:
        dtype = torch.bfloat16
        spec = GLM5_LAYER if args.model == "glm5_layer" else QWEN3_5_MOE
        model = CausalLM.random(config_from_dict(spec), spec, dtype)
    adapters = lora.add_adapters(model, lora.LoraConfig(16, 32, 0.0, model.family.attention_targets, True), dtype,
                                 "cpu", 0)
    gen = torch.Generator().manual_seed(0)
    batch = Packed.from_documents([torch.randint(0, model.cfg.vocab_size, (args.tokens,), generator=gen).tolist()])
    with FlopShare(ops.resolve(args.cpp_ops)) as share:
        model.use_ops(share.table)
        model.loss(batch, batch.num_targets).backward()
        optimizer = AdamW(adapters, share.table)
        share.table.v4_clip_grad_norm(optimizer.grads(), 1.0)
        optimizer.step(1e-4)
    s = share.summary()
    print(f"{args.model}, {args.tokens} tokens, LoRA step, --cpp_ops={args.cpp_ops}: {s['total'] / 1e9:.1f} GFLOP, "
          f"{100 * s['cpp_share']:.1f}% in C++ ops")
    for name, flops in s["by_op"].items():
        print(f"  {name}: {flops / 1e9:.2f} GFLOP ({100 * flops / s['total']:.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
