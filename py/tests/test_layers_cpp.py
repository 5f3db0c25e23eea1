"""Each family's C++ path end to end (v4_glm5_layer_forward / v4_qwen3_5_layer_forward, one call
per layer, every op inside in C++): transformers' goldens (logits, loss, every parameter's
gradient), activation checkpointing that repeats the first pass's dropout and routing, and
training that follows the reference path step by step."""

import pytest
import torch

from v4train import trainer as train
from golden_cases import BASE, CASES, CHAT, QWEN_BASE, golden, run
from v4train import data, hf_checkpoint, lora, ops
from v4train.layer_call import LayerOptions
from v4train.model import Packed
from v4train.testing.compare import assert_close, assert_rel_close
from v4train.optim import AdamW
from v4train.tokenizer import Tokenizer

# family: (the C++ ops its layers run on, the golden case with LoRA dropout to checkpoint, the bundled base)
FAMILIES = {
    "glm5": ({"v4_glm5_layer_forward", "v4_mla_dsa_attention", "v4_glm5_moe", "v4_mlp"}, "glm5", BASE),
    "qwen3_5": ({"v4_qwen3_5_layer_forward", "v4_gated_deltanet", "v4_gated_attention", "v4_qwen3_5_moe",
                 "v4_causal_conv1d", "v4_gated_delta_rule"}, "qwen3_5_moe", QWEN_BASE),
}


@pytest.mark.parametrize("case", CASES)
def test_cpp_layers_match_transformers(case):
    model_dir, tensors, meta = golden(case)
    model, _ = hf_checkpoint.load(model_dir, torch.float32)
    table = ops.resolve("all")
    assert FAMILIES[model.family.name][0] <= set(table.cpp)
    model.use_ops(table)
    logits, loss = run(model, tensors["input_ids"])
    assert_rel_close(logits, tensors["logits"], f"{case} logits")
    assert_rel_close(loss, torch.tensor(meta["loss"]), f"{case} loss")
    have = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert sorted(have) == sorted(meta["grads"])
    for n in sorted(have):
        assert_rel_close(have[n], meta["grads"][n], f"{case} gradient of {n}", truth=meta["grad64s"][n], spread=meta["spreads"][n])


def _lora_grads(model, batch, checkpointing, seed):
    model.checkpointing = checkpointing
    model.zero_grad()
    torch.manual_seed(seed)  # the LoRA dropout masks
    loss = model.loss(batch, 100.0)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_checkpointed_layer_recomputes_the_same_dropout_and_routing(family):
    model_dir, tensors, _ = golden(FAMILIES[family][1])
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


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cpp_and_reference_paths_train_alike(family):
    """The bundled base of the family (4 layers: GLM-5's DSA and MoE; Qwen3.5's Gated DeltaNet,
    gated attention and MoE) trained 30 steps in fp32 with LoRA on the C++ path, its own AdamW
    updates carrying it from step to step; before each step the reference path is given the same
    adapters and optimizer state, and its step must give the same loss and gradient norm.

    Step by step from one state, not two free runs: the top-k selections (DSA keys, experts) meet
    near-ties along 30 steps, and which way one falls depends on summation order, so that two
    free fp32 runs part by 3e-4 at some step even on the reference path alone (one thread against
    two, measured) while each step from one state agrees to the fp32 tolerance. (Not the updated
    adapters element by element either: AdamW's early steps move a weight by about lr whatever
    its gradient's size, so a gradient of rounding size moves by lr either way; v4_adam_step's
    own parity covers the update.)"""
    base = FAMILIES[family][2]
    records = data.read_records(CHAT, Tokenizer(base))
    runs = {}
    for spec in ("none", "all"):
        model, _ = hf_checkpoint.load(base, torch.float32)
        table = ops.resolve(spec)
        model.use_ops(table)
        adapters = lora.add_adapters(model, lora.LoraConfig(8, 16, 0.0, model.family.attention_targets, True),
                                     torch.float32, "cpu", 0)
        runs[spec] = (model, adapters, AdamW(adapters, table))
    (ref, ref_adapters, ref_opt), (cpp, cpp_adapters, cpp_opt) = runs["none"], runs["all"]
    losses = []
    for step, i in enumerate(range(0, 120, 4)):
        with torch.no_grad():
            for n, p in ref_adapters.items():
                p.copy_(cpp_adapters[n])
        ref_opt.load_state(cpp_opt.state_tensors(), cpp_opt.step_count)
        expected = train.train_step(ref, ref_opt, [records[i:i + 4]], 2e-3, 1.0, "cpu")
        actual = train.train_step(cpp, cpp_opt, [records[i:i + 4]], 2e-3, 1.0, "cpu")
        assert_close(torch.tensor([actual.loss, actual.grad_norm]), torch.tensor([expected.loss, expected.grad_norm]),
                     f"step {step}: loss and gradient norm, C++ vs reference")
        losses.append(actual.loss)
    assert losses[-1] < 0.8 * losses[0], "the C++ path trains"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_reference_layers_over_the_cpp_ops_checkpoint(family):
    """--cpp_ops without the layer op: the reference layer calls the C++ sub-ops, and its
    checkpointing (torch.utils.checkpoint) stops each recomputation early by raising an exception
    through the C++ op it is recomputing; that exception must reach torch as itself (it reached it
    as a bare RuntimeError), and the gradients equal the plain pass's."""
    model_dir, tensors, _ = golden(FAMILIES[family][1])
    model, _ = hf_checkpoint.load(model_dir, torch.float32)
    table = ops.resolve("all")
    model.use_ops(ops.OpTable(table.ops, table.cpp - {"v4_glm5_layer_forward", "v4_qwen3_5_layer_forward"}))
    for n, p in model.named_parameters():
        p.requires_grad_(not model.family.is_frozen(n))
    batch = Packed.from_rows(tensors["input_ids"])
    plain_loss, plain = _lora_grads(model, batch, False, seed=0)
    ckpt_loss, ckpt = _lora_grads(model, batch, True, seed=0)
    assert torch.equal(ckpt_loss, plain_loss)
    for n in plain:
        assert_close(ckpt[n], plain[n], f"checkpointed gradient of {n}")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_checkpointed_layer_in_blocks_recomputes_each_block_as_it_ran(family):
    """An MoE layer with its MoE in blocks of 3 tokens (cc/common/checkpoint.h), LoRA dropout on,
    every adapter nonzero: checkpointed (each block recomputed with the first pass's masks and
    routing, then differentiated, its input's gradient and its weights' gathered) against the
    plain call in the same blocks, which draws the same masks from the same seed: the same output
    and gradients. Another seed gives other gradients (the masks matter)."""
    model_dir, tensors, _ = golden(FAMILIES[family][1])
    model, _ = hf_checkpoint.load(model_dir, torch.float32)
    lora.add_adapters(model, lora.LoraConfig(4, 8, 0.3, model.family.attention_targets, True), torch.float32, "cpu", 0)
    index = 2 if family == "glm5" else 0  # an MoE layer; GLM-5's with its own ("full") indexer
    layer = model.layers[index]
    batch = Packed.from_rows(tensors["input_ids"])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch.positions.numel(), model.cfg.hidden_size, generator=gen)
    trained = dict((n, p) for n, p in layer.named_parameters() if "lora_" in n)
    for p in trained.values():  # lora_B starts at 0: every adapter in play
        p.data.normal_(0, 0.1, generator=gen)
    weigh = torch.randn(x.shape, generator=gen)
    op = ops.resolve("all")[model.family.layer_op]
    assert x.shape[0] > 3

    def run(checkpoint, seed):
        torch.manual_seed(seed)
        h = x.clone().requires_grad_(True)
        options = LayerOptions(layer.lora_scaling, 0.3, checkpoint, checkpoint_block=3)
        args = (h, layer.weights, layer.cfg, index, batch.batch, options)
        out = op(*args, None)[0] if family == "glm5" else op(*args)
        for p in trained.values():
            p.grad = None
        (out * weigh).sum().backward()
        return out.detach(), {"hidden": h.grad, **{n: p.grad.clone() for n, p in trained.items()}}

    plain_out, plain = run(False, 5)
    ckpt_out, ckpt = run(True, 5)
    assert_close(ckpt_out, plain_out, "checkpointed output")
    for n in plain:
        assert_close(ckpt[n], plain[n], f"checkpointed gradient of {n}")
    _, other = run(True, 6)
    assert any(not torch.equal(other[n], plain[n]) for n in plain), "dropout is on: another seed gives other gradients"
