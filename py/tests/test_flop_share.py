"""How much of a training step's compute runs in C++ ops: measured with v4train.flops.FlopShare
on the bundled GLM-5-architecture model (LoRA, as glm5.flags trains it), printed, and checked
for what the architecture promises: no compute outside an op; and on a Qwen3.5-MoE-architecture
model."""

import torch
import torch.nn.functional as F

from v4train import trainer as train
from golden_cases import BASE, CHAT
from v4train import data, hf_checkpoint, lora, ops
from v4train.flops import OUTSIDE, FlopShare
from v4train.models import config_from_dict
from v4train.model import CausalLM, Packed
from v4train.optim import AdamW
from v4train.reference.lora import Linear
from v4train.reference.mlp import MlpWeights
from v4train.tokenizer import Tokenizer


def _step_share(spec: str, leak=None) -> dict:
    model, _ = hf_checkpoint.load(BASE)
    adapters = lora.add_adapters(model, lora.LoraConfig(8, 16, 0.0, model.family.attention_targets, True),
                                 torch.float32, "cpu", 0)
    records = data.read_records(CHAT, Tokenizer(BASE))[:8]
    with FlopShare(ops.resolve(spec)) as share:
        model.use_ops(share.table)
        if leak is not None:
            leak(model)
        train.train_step(model, AdamW(adapters, share.table), [records[:4], records[4:]], 1e-3, 1.0, "cpu")
    return share.summary()


def test_share_of_a_training_step_in_cpp_ops():
    s = _step_share("all")
    print(f"bundled GLM-5-architecture model, LoRA step, --cpp_ops=all: {s['total'] / 1e9:.2f} GFLOP, "
          f"{100 * s['cpp_share']:.1f}% in C++ ops; by op (GFLOP): "
          + ", ".join(f"{k} {v / 1e9:.3f}" for k, v in s["by_op"].items()))
    assert OUTSIDE not in s["by_op"], f"compute outside any op: {s['by_op'][OUTSIDE]} FLOPs"
    assert s["total"] == sum(s["by_op"].values())
    assert s["cpp_share"] >= 0.99, "GLM-5's step runs in C++ ops"
    assert _step_share("none")["cpp"] == 0


QWEN3_5_MOE = {"model_type": "qwen3_5_moe", "num_hidden_layers": 4, "vocab_size": 256, "hidden_size": 64,
               "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
               "shared_expert_intermediate_size": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
               "linear_key_head_dim": 16, "linear_value_head_dim": 16, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16}  # 3 Gated DeltaNet layers + 1 gated attention


def test_share_of_a_qwen3_5_moe_step_in_cpp_ops():
    model = CausalLM.random(config_from_dict(QWEN3_5_MOE), QWEN3_5_MOE, torch.float32)
    lora.add_adapters(model, lora.LoraConfig(8, 16, 0.0, model.family.attention_targets, True), torch.float32, "cpu", 0)
    gen = torch.Generator().manual_seed(0)
    batch = Packed.from_documents([torch.randint(0, 256, (n,), generator=gen).tolist() for n in (70, 30)])
    with FlopShare(ops.resolve("all")) as share:
        model.use_ops(share.table)
        model.loss(batch, batch.num_targets).backward()
    s = share.summary()
    print(f"Qwen3.5-MoE-architecture model (3 Gated DeltaNet + 1 gated attention layers), LoRA, --cpp_ops=all: "
          f"{100 * s['cpp_share']:.1f}% of {s['total'] / 1e9:.3f} GFLOP in C++ ops; by op (GFLOP): "
          + ", ".join(f"{k} {v / 1e9:.3f}" for k, v in s["by_op"].items()))
    assert OUTSIDE not in s["by_op"], f"compute outside any op: {s['by_op'][OUTSIDE]} FLOPs"
    assert s["cpp_share"] >= 0.99, "Qwen3.5's step runs in C++ ops"


def test_the_count_sees_compute_outside_the_ops():
    def leak(model):  # a matmul in the model container, outside any op
        forward = model.hidden_states
        model.hidden_states = lambda batch: F.linear(forward(batch), torch.eye(model.cfg.hidden_size))
    s = _step_share("all", leak)
    assert s["by_op"].get(OUTSIDE, 0) > 0


def test_backward_is_attributed_to_the_op_that_made_it():
    """v4_mlp in C++: three products forward (gate, up, down: 2 T H I FLOPs each), six backward (the
    input's and the weight's gradient of each map), all counted under the op. v4_cross_entropy_loss
    forms its gradients in the forward pass: three products of T x H x V a chunk, none backward."""
    T, H, I, V = 12, 16, 40, 50
    x = torch.randn(T, H, requires_grad=True)
    weights = MlpWeights(*(Linear(torch.randn(*shape, requires_grad=True)) for shape in ((I, H), (I, H), (H, I))))
    with FlopShare(ops.resolve("mlp")) as share:
        share.table.v4_mlp(x, weights, 0.0, 0.0).sum().backward()
    assert share.summary()["by_op"] == {"v4_mlp (cpp)": 9 * 2 * T * H * I}
    h, w = torch.randn(T, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    with FlopShare(ops.resolve("cross_entropy_loss")) as share:
        share.table.v4_cross_entropy_loss(h, w, torch.randint(0, V, (T,)), 1.0, 4).backward()
    assert share.summary()["by_op"] == {"v4_cross_entropy_loss (cpp)": 3 * 2 * T * H * V}
