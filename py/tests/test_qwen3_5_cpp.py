"""Qwen3.5 on the C++ path (v4_qwen3_5_layer_forward, one call per layer, with v4_gated_deltanet,
v4_gated_attention and v4_qwen_moe inside): transformers' goldens (logits, loss, every
parameter's gradient), activation checkpointing that repeats the first pass's dropout and routing,
and training that follows the reference path step by step."""

import pytest
import torch

import train
from golden_cases import CASES, CHAT, QWEN_BASE, golden, run
from v4train.models.causal_lm import Packed
from v4train import data, hf_checkpoint, lora, ops
from v4train.ops.compare import assert_close, assert_rel_close
from v4train.optim import AdamW
from v4train.tokenizer import Tokenizer

QWEN_CPP = {"v4_qwen3_5_layer_forward", "v4_gated_deltanet", "v4_gated_attention", "v4_qwen_moe", "v4_causal_conv1d",
            "v4_gated_delta_rule"}


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("qwen3_5")])
def test_cpp_blocks_match_transformers(case):
    model_dir, tensors, meta = golden(case)
    model, _ = hf_checkpoint.load(model_dir, torch.float32)
    table = ops.resolve("all")
    assert QWEN_CPP <= set(table.cpp)
    model.use_ops(table)
    logits, loss = run(model, tensors["input_ids"])
    assert_rel_close(logits, tensors["logits"], f"{case} logits")
    assert_rel_close(loss, torch.tensor(meta["loss"]), f"{case} loss")
    have = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert sorted(have) == sorted(meta["grads"])
    for n in sorted(have):
        assert_rel_close(have[n], meta["grads"][n], f"{case} gradient of {n}", truth=meta["grad64s"][n])


def _lora_grads(model, batch, checkpointing, seed):
    model.checkpointing = checkpointing
    model.zero_grad()
    torch.manual_seed(seed)  # the LoRA dropout masks
    loss = model.loss(batch, 100.0)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_checkpointed_layer_recomputes_the_same_dropout_and_routing():
    model_dir, tensors, _ = golden("qwen3_5_moe")
    model, _ = hf_checkpoint.load(model_dir, torch.float32)
    model.use_ops(ops.resolve("all"))
    lora.add_adapters(model, lora.LoraConfig(4, 8, 0.3, model.family.attention_targets, True), torch.float32, "cpu", 0)
    model.train()
    batch = Packed.from_rows(tensors["input_ids"])
    plain_loss, plain = _lora_grads(model, batch, False, seed=7)
    ckpt_loss, ckpt = _lora_grads(model, batch, True, seed=7)
    assert torch.equal(ckpt_loss, plain_loss)
    assert sorted(ckpt) == sorted(plain)
    for n in plain:
        assert_close(ckpt[n], plain[n], f"checkpointed gradient of {n}")
    _, other = _lora_grads(model, batch, True, seed=8)
    assert any(not torch.equal(other[n], plain[n]) for n in plain), "dropout is on: another seed gives other gradients"


def test_cpp_and_reference_paths_train_alike():
    """The bundled Qwen3.5-MoE-architecture base (3 Gated DeltaNet + 1 gated attention layers, MoE)
    trained 30 steps from the same seed on the reference path and on the C++ path: the losses
    agree step by step in fp32, the same run in float64 arbitrating (the C++ delta rule sums in
    another order than the reference's, and 30 updates carry those roundings forward: the C++
    curve must then be no further from the float64 one than the reference's is)."""
    records = data.read_records(CHAT, Tokenizer(QWEN_BASE))
    batches = [records[i:i + 4] for i in range(0, 120, 4)]
    curves = {}
    for spec, dtype in (("none", torch.float32), ("all", torch.float32), ("none", torch.float64)):
        model, _ = hf_checkpoint.load(QWEN_BASE, dtype)
        table = ops.resolve(spec)
        model.use_ops(table)
        adapters = lora.add_adapters(model, lora.LoraConfig(8, 16, 0.0, model.family.attention_targets, True),
                                     dtype, "cpu", 0)
        optimizer = AdamW(adapters, table)
        curves[spec, dtype] = torch.tensor([float(train.train_step(model, optimizer, [b], 2e-3, 1.0, "cpu").loss)
                                            for b in batches])
    cpp, reference, truth = curves["all", torch.float32], curves["none", torch.float32], curves["none", torch.float64]
    assert cpp[-1] < 0.8 * cpp[0], "it trains"
    assert_close(cpp, reference, "loss per step, C++ vs reference", truth=truth)
