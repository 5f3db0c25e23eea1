"""LoRA: PEFT-format adapters that peft loads onto transformers with the same logits; evaluate
with --adapter_dir; atomic checkpoints; gradient checkpointing; the startup self-check."""

import json
import os
import warnings

import pytest
import torch

from golden_cases import BASE, CHAT, QWEN_BASE, golden, last_json, run_cli
from v4train.testing.compare import assert_rel_close
from v4train import checkpoint, hf_checkpoint, lora, ops
from v4train.model import Packed
from v4train.op import Op
from v4train.testing.check import self_check
from v4train.optim import AdamW


@pytest.fixture(scope="module")
def trained_adapter(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    result = run_cli("train.py", "--model_dir=" + BASE, "--data=" + CHAT, "--dtype=float32", "--seq_len=128",
                     "--micro_batch_size=2", "--max_steps=3", "--lr=5e-3", "--lora_r=4", "--lora_alpha=8",
                     "--lora_target_modules=q_a_proj,kv_b_proj,o_proj", "--lora_dropout=0.1", f"--output_dir={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    return str(out / "checkpoint-3")


def test_peft_loads_the_adapter_onto_transformers_with_the_same_logits(trained_adapter, tmp_path):
    import transformers
    from peft import PeftModel

    ids = torch.randint(0, 384, (2, 40), generator=torch.Generator().manual_seed(0))
    model, _ = hf_checkpoint.load(BASE)
    lora.load_peft(model, trained_adapter, torch.float32, "cpu")
    with torch.no_grad():
        ours = model.logits(Packed.from_rows(ids)).reshape(2, 40, -1)
        plain = hf_checkpoint.load(BASE)[0].logits(Packed.from_rows(ids)).reshape(2, 40, -1)
    base = transformers.AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32, attn_implementation="eager")
    peft_model = PeftModel.from_pretrained(base, trained_adapter)
    with torch.no_grad():
        theirs = peft_model(input_ids=ids).logits
    assert_rel_close(ours, theirs, "v4train vs transformers + peft")
    assert ((ours - plain).norm() / plain.norm()) > 1e-4, "the trained adapter changes the logits"
    # And the loss //py:evaluate reports with the adapter is transformers + peft's.
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in ids.tolist()))
    result = run_cli("evaluate.py", f"--model_dir={BASE}", f"--adapter_dir={trained_adapter}", f"--data={data}")
    assert result.returncode == 0, result.stderr[-2000:]
    with torch.no_grad():
        expected = peft_model(input_ids=ids, labels=ids).loss
    assert_rel_close(torch.tensor(last_json(result.stdout)["loss"]), expected, "evaluate --adapter_dir loss")


def test_qwen3_5_flags_train_the_bundled_model_and_peft_loads_its_adapter(tmp_path):
    """The out-of-the-box Qwen3.5 recipe (py/flags/qwen3_5.flags: the bundled Qwen3.5-MoE-architecture
    model, LoRA on the attention and linear-attention projections and the experts, the layers'
    blocks in C++), shortened: the loss falls, and peft loads the adapter onto transformers'
    Qwen3.5-MoE with v4train's logits."""
    import transformers
    from peft import PeftModel

    out = tmp_path / "run"
    result = run_cli("train.py", "--flagfile=qwen3_5.flags", "--max_steps=30", "--warmup_steps=2",
                     "--eval_interval=30", "--save_interval=30", f"--output_dir={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json(result.stdout)
    assert summary["final_loss"] < 0.6 * summary["first_loss"], summary
    adapter = str(out / "checkpoint-30")
    ids = torch.randint(0, 384, (2, 40), generator=torch.Generator().manual_seed(0))
    model, _ = hf_checkpoint.load(QWEN_BASE)
    lora.load_peft(model, adapter, torch.float32, "cpu")
    with torch.no_grad():
        ours = model.logits(Packed.from_rows(ids)).reshape(2, 40, -1)
    base = transformers.AutoModelForCausalLM.from_pretrained(QWEN_BASE, dtype=torch.float32)
    with torch.no_grad():
        theirs = PeftModel.from_pretrained(base, adapter)(input_ids=ids).logits
    assert_rel_close(ours, theirs, "v4train vs transformers + peft, Qwen3.5-MoE")


def test_checkpoint_writes_are_atomic(tmp_path, monkeypatch):
    model, _ = hf_checkpoint.load(golden("glm5")[0])
    lcfg = lora.LoraConfig(2, 4, 0.0, ("o_proj",), False)
    adapters = lora.add_adapters(model, lcfg, torch.float32, "cpu", 0)
    opt = AdamW(adapters, ops.REFERENCE)
    kw = dict(model=model, adapters=adapters, lcfg=lcfg, optimizer_state=opt.state_tensors(),
              optimizer_steps=opt.step_count, state={"loader": {}}, base_model_dir=BASE,
              tokenizer_dir=None, keep=3)
    checkpoint.save(str(tmp_path), 1, **kw)
    before = (tmp_path / "checkpoint-1" / "adapter_model.safetensors").read_bytes()

    def crash(*a, **k):
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(checkpoint, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(str(tmp_path), 2, **kw)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(str(tmp_path), 1, **kw)  # overwriting the same step
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1"]
    assert (tmp_path / "checkpoint-1" / "adapter_model.safetensors").read_bytes() == before
    assert checkpoint.latest(str(tmp_path)) == str(tmp_path / "checkpoint-1")


@pytest.mark.parametrize("case", ["glm5", "qwen3_5_moe"])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(case):
    model_dir, tensors, _ = golden(case)
    results = []
    for recompute in (False, True):
        model, _ = hf_checkpoint.load(model_dir)
        model.checkpointing = recompute
        lcfg = lora.LoraConfig(4, 8, 0.1, ("o_proj",), True)
        adapters = lora.add_adapters(model, lcfg, torch.float32, "cpu", 0)
        for t in adapters.values():
            t.requires_grad_(True)
        torch.manual_seed(0)  # LoRA dropout: the recomputation must see the same masks
        loss = model.loss(Packed.from_rows(tensors["input_ids"]), 100.0)
        loss.backward()
        results.append((loss.detach(), torch.cat([t.grad.reshape(-1) for t in adapters.values()])))
    assert_rel_close(results[1][0], results[0][0], f"{case} loss")
    assert_rel_close(results[1][1], results[0][1], f"{case} adapter gradients")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_self_check_passes_the_real_ops_and_stops_on_a_mismatch_naming_the_op(dtype, monkeypatch):
    self_check(ops.resolve("all"), ops.REFERENCE, dtype, "cpu")  # the real pairs agree
    # An rms_norm that ignores zero_centered: the self-check's samples include zero-centred ones.
    real = Op.cpp
    plain = lambda x, w, eps, zero_centered=False: real(ops.OPS["v4_rms_norm"])(x, w, eps, False)  # noqa: E731
    monkeypatch.setattr(Op, "cpp", lambda op: plain if op.name == "v4_rms_norm" else real(op))
    with pytest.raises(ValueError, match="self-check: the C\\+\\+ op v4_rms_norm differs from its reference"):
        self_check(ops.resolve("rms_norm"), ops.REFERENCE, dtype, "cpu")


@pytest.mark.parametrize("case,targets", [
    ("qwen3_5_moe", ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj")),
    ("qwen3_5", ("q_proj", "o_proj", "in_proj_qkv", "out_proj")),
])
def test_qwen_adapters_load_in_peft_too(case, targets, tmp_path):
    import transformers
    from peft import PeftModel

    model_dir, tensors, _ = golden(case)
    model, _ = hf_checkpoint.load(model_dir)
    lcfg = lora.LoraConfig(4, 8, 0.1, targets, experts=True)  # (--lora_experts, the default, on the dense one too)
    adapters = lora.add_adapters(model, lcfg, torch.float32, "cpu", 0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in adapters.items():
            if name.endswith("lora_B"):
                t.copy_(torch.randn(t.shape, generator=gen) * 0.05)
    lora.save_peft(model, adapters, lcfg, str(tmp_path), model_dir)
    ids = tensors["input_ids"]
    model.eval()  # no LoRA dropout
    with torch.no_grad():
        ours = model.logits(Packed.from_rows(ids)).reshape(tensors["logits"].shape)
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                                 attn_implementation="eager")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            theirs = PeftModel.from_pretrained(base, str(tmp_path))(input_ids=ids).logits
    assert_rel_close(ours, theirs, f"{case}: v4train vs transformers + peft")
    assert not [w for w in caught if "target_parameters" in str(w.message)], "the adapter names no absent experts"
    assert ((ours - tensors["logits"]).norm() / tensors["logits"].norm()) > 1e-3, "the adapter changes the logits"


def test_all_linear_targets_every_linear_map_of_the_layers_but_routers_indexer_and_experts():
    """PEFT's --lora_target_modules=all-linear (refused before; a QA pass): the GLM-5 base's MLA
    projections, its dense layer's MLP and the shared experts; no router, DSA indexer or routed expert."""
    model, _ = hf_checkpoint.load(BASE)
    assert set(lora.expand_targets(model, ["all-linear"])) == {
        "self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj",
        "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.shared_experts.gate_proj",
        "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj"}


def test_mlp_targets_of_an_moe_model_are_said_not_to_load_in_peft(tmp_path):
    """README's known limit, said where it bites (a review: all-linear gives such adapters)."""
    result = run_cli("train.py", "--model_dir=" + BASE, "--data=" + CHAT, "--dtype=float32", "--seq_len=64",
                     "--max_steps=1", "--lora_target_modules=all-linear", f"--output_dir={tmp_path / 'o'}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--lora_target_modules: mlp.down_proj, mlp.gate_proj, mlp.shared_experts.down_proj, " \
           "mlp.shared_experts.gate_proj, mlp.shared_experts.up_proj, mlp.up_proj of an MoE model train and reload in " \
           "v4train, but peft 0.21 does not load such adapters" in result.stderr
