"""The reference path against transformers 5.24 on every golden checkpoint, in fp32."""

import pytest
import torch

from v4train.testing.compare import assert_rel_close
from golden_cases import CASES, golden, run
from v4train import hf_checkpoint
from v4train.model import Packed


def test_every_required_case_is_there():
    assert set(CASES) >= {"glm5", "glm5_yarn_fp8", "qwen3_5_moe", "qwen3_5_moe_sharded", "qwen3_5_moe_vl", "qwen3_5"}


@pytest.mark.parametrize("case", CASES)
def test_logits_loss_and_gradients_match_transformers(case):
    model_dir, tensors, meta = golden(case)
    model, _ = hf_checkpoint.load(model_dir, torch.float32)
    logits, loss = run(model, tensors["input_ids"])
    rel_logits = assert_rel_close(logits, tensors["logits"], f"{case} logits")
    rel_loss = assert_rel_close(loss, torch.tensor(meta["loss"]), f"{case} loss")
    have = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert sorted(have) == sorted(meta["grads"]), f"{case}: parameters with gradients differ from transformers'"
    # Each parameter's gradient on its own: a small parameter's gradient (A_log, dt_bias) or a
    # sign error cannot hide behind a large one. Where fp32 rounding is large, the float64
    # evaluation of transformers arbitrates (assert_rel_close).
    rel_grads = {n: assert_rel_close(have[n], meta["grads"][n], f"{case} gradient of {n}", truth=meta["grad64s"][n], spread=meta["spreads"][n])
                 for n in sorted(have)}
    worst = max(rel_grads, key=rel_grads.get)
    print(f"{case}: relative error logits {rel_logits:.2e}, loss {rel_loss:.2e}, "
          f"gradients up to {rel_grads[worst]:.2e} ({worst})")


def test_vl_checkpoint_reports_the_skipped_vision_tower():
    model_dir, _, _ = golden("qwen3_5_moe_vl")
    _, report = hf_checkpoint.load(model_dir)
    assert report["skipped"] == {"vision tower": 21}


def test_the_goldens_would_catch_a_wrong_small_gradient():
    """A_log, dt_bias and in_proj_a have the smallest Qwen3.5 gradients: one of them wrong (here
    1% off, or negated) must fail the per-parameter comparison."""
    model_dir, tensors, meta = golden("qwen3_5_moe")
    model, _ = hf_checkpoint.load(model_dir, torch.float32)
    run(model, tensors["input_ids"])
    for name in ("model.layers.0.linear_attn.A_log", "model.layers.0.linear_attn.dt_bias",
                 "model.layers.1.linear_attn.in_proj_a.weight"):
        grad = model.get_parameter(name).grad
        assert_rel_close(grad, meta["grads"][name], name, truth=meta["grad64s"][name], spread=meta["spreads"][name])
        for wrong in (1.01 * grad, -grad):
            with pytest.raises(AssertionError, match="relative error norm"):
                assert_rel_close(wrong, meta["grads"][name], name, truth=meta["grad64s"][name], spread=meta["spreads"][name])


def _logits_rel_error(case, **cfg_changes):
    import dataclasses

    model_dir, tensors, _ = golden(case)
    model, _ = hf_checkpoint.load(model_dir)
    model.cfg = dataclasses.replace(model.cfg, **cfg_changes)
    for layer in model.layers:
        layer.cfg = model.cfg
    with torch.no_grad():
        logits = model.logits(Packed.from_rows(tensors["input_ids"])).reshape(tensors["logits"].shape)
    return ((logits - tensors["logits"]).norm() / tensors["logits"].norm()).item()


def test_the_goldens_would_catch_a_broken_sparse_selection_or_rope():
    # With index_topk above the sequence length the DSA selection is all keys: the golden must differ.
    assert _logits_rel_error("glm5", index_topk=10_000) > 1e-3
    from v4train.models.config import Rope

    assert _logits_rel_error("glm5_yarn_fp8", rope=Rope(theta=10000.0, dim=16)) > 1e-3
