"""How much of a training step's compute runs in C++ ops: measured with v4train.flops.FlopShare
on the bundled GLM-5-architecture model (LoRA, as glm5.flags trains it), printed, and checked
for what the architecture promises: no compute outside an op."""

import torch
import torch.nn.functional as F

import train
from golden_cases import BASE, CHAT
from v4train import data, hf_checkpoint, lora, ops
from v4train.flops import OUTSIDE, FlopShare
from v4train.optim import AdamW
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


def test_the_count_sees_compute_outside_the_ops():
    def leak(model):  # a matmul in the model container, outside any op
        forward = model.hidden_states
        model.hidden_states = lambda batch: F.linear(forward(batch), torch.eye(model.cfg.hidden_size))
    s = _step_share("all", leak)
    assert s["by_op"].get(OUTSIDE, 0) > 0


def test_backward_is_attributed_to_the_op_that_made_it():
    """v4_cross_entropy_loss in C++: forward T x H x V x 2, backward recomputes the logits and
    forms both gradients: 3 more products of the same size, all counted under the op."""
    T, H, V = 12, 16, 50
    h, w = torch.randn(T, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    with FlopShare(ops.resolve("cross_entropy_loss")) as share:
        share.table.v4_cross_entropy_loss(h, w, torch.randint(0, V, (T,)), 1.0, 4).backward()
    assert share.summary()["by_op"] == {"v4_cross_entropy_loss (cpp)": 4 * 2 * T * H * V}
