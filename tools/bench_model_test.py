"""tools/bench_model.py compares like with like: on each proxy, shrunk to the bundled test
model's config, v4train (every op in C++) gives transformers' loss and gradients on the very
parameter tensors transformers holds."""

import copy
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import bench_model  # noqa: E402
from v4train import ops  # noqa: E402
from v4train.model import Packed  # noqa: E402
from v4train.testing.compare import assert_rel_close, rounding_spread  # noqa: E402

NOT_CONFIG = {"architectures", "model_type", "dtype"}


@pytest.mark.parametrize("model", sorted(bench_model.PROXIES))
def test_the_proxy_is_the_same_model_on_both_sides(model):
    with open(os.path.join(ROOT, "testdata", "sft", f"{model}_config.json")) as f:
        small = {k: v for k, v in json.load(f).items() if k not in NOT_CONFIG}
    hf, ours, cfg = bench_model.build(model, torch.float32, "cpu", **small)
    ours.use_ops(ops.resolve("all"))
    theirs = {**dict(hf.named_parameters()), **dict(hf.named_buffers())}
    not_shared = [n for n, p in ours.named_parameters() if n not in theirs or p.data_ptr() != theirs[n].data_ptr()]
    assert not_shared == [], "v4train's tensors must be transformers' own (same name, same storage)"
    # Longer than the GLM-5 test model's index_topk (64), so that its sparse attention selects.
    ids = torch.randint(0, cfg.vocab_size, (1, 96), generator=torch.Generator().manual_seed(1))
    # transformers in float64 arbitrates where fp32 rounding of either side exceeds the tolerance
    # (DeltaNet's dt_bias and A_log gradients sum with heavy cancellation), judged by how far one
    # unit of fp32 roundoff in the weights moves it (assert_rel_close).
    expected, hf_grads = loss_and_grads(hf, ids)
    hf64 = copy.deepcopy(hf).double()
    hf64.set_experts_implementation("eager")  # torch._grouped_mm has no float64
    _, truth_grads = loss_and_grads(hf64, ids)
    spreads = rounding_spread(hf64, lambda m: loss_and_grads(m, ids)[1])
    batch = Packed.from_rows(ids)
    loss = ours.loss(batch, batch.num_targets)
    loss.backward()
    assert_rel_close(loss, expected, f"{model} loss")
    for n, p in ours.named_parameters():
        if p.requires_grad:
            assert_rel_close(p.grad, hf_grads[n], f"{model} gradient of {n}", truth_grads[n], spreads[n])


def loss_and_grads(hf, ids):
    loss = hf(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None}
    bench_model.zero_grads(hf)
    return loss.detach(), grads


# The linear maps each family's released FP8 checkpoint keeps in bf16 (docs/models.md's table; Qwen3.5's
# shared_expert_gate too, which v4train takes as a plain tensor, never FP8).
RELEASED_BF16 = {"glm5": ("self_attn.indexer.weights_proj.weight",),
                 "qwen3_5": ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight")}


@pytest.mark.parametrize("model", sorted(bench_model.PROXIES))
def test_the_fp8_twin_is_the_dequantised_model_in_fewer_bytes(model):
    """--fp8 compares like with like: the model kept in FP8 gives the loss and LoRA gradients of
    the same model dequantised to bf16 (the C++ ops dequantise just in time), in fewer bytes; its
    FP8 maps are the release's (every layer's linear map but those the release keeps in bf16)."""
    with open(os.path.join(ROOT, "testdata", "sft", f"{model}_config.json")) as f:
        small = {k: v for k, v in json.load(f).items() if k not in NOT_CONFIG}
    hf, _, cfg = bench_model.build(model, torch.float32, "cpu", **small)
    dense, fp8 = bench_model.fp8_pair(hf, cfg, rank=4)
    assert bench_model.weight_bytes(fp8)[1].get("float8_e4m3fn", 0) > 0
    weights = fp8.weights()
    in_fp8 = {n for n, t in weights.items() if t.dtype == torch.float8_e4m3fn}
    kept = {n for n in bench_model.linear_map_names(cfg) & weights.keys() if n.endswith(RELEASED_BF16[model])}
    assert kept and not kept & in_fp8, f"{model}: the release keeps {sorted(kept)} in bf16"
    assert in_fp8 == bench_model.linear_map_names(cfg) & weights.keys() - kept
    assert bench_model.weight_bytes(fp8)[0] < 0.75 * bench_model.weight_bytes(dense)[0]
    ids = torch.randint(0, cfg.vocab_size, (1, 96), generator=torch.Generator().manual_seed(2))
    batch = Packed.from_rows(ids)
    grads = {}
    for name, m in (("dense", dense), ("fp8", fp8)):
        m.use_ops(ops.resolve("all"))
        with torch.no_grad():  # B != 0, so that the adapters' outputs count
            for n, p in m.named_parameters():
                if n.endswith("lora_B"):
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.01)
        loss = m.loss(batch, batch.num_targets)
        loss.backward()
        grads[name] = (loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    assert grads["dense"][1].keys() == grads["fp8"][1].keys() and grads["dense"][1]
    assert_rel_close(grads["fp8"][0], grads["dense"][0], f"{model} loss")
    for n, g in grads["dense"][1].items():
        assert_rel_close(grads["fp8"][1][n], g, f"{model} gradient of {n}")


def test_the_full_size_layer_is_built_in_fp8_and_trains_its_adapters():
    """--full_layer's model (here at the bundled test model's widths): every linear map of its
    layers that the release quantises float8 with one scale per 128 x 128 block, the rest bf16
    (the indexer's weights_proj fp32, as transformers keeps it); a LoRA step reaches every
    adapter and no frozen weight."""
    from v4train.models import config_from_dict

    with open(os.path.join(ROOT, "testdata", "sft", "glm5_config.json")) as f:
        config = json.load(f)
    cfg = config_from_dict(config, "glm5_config.json")
    model = bench_model.random_fp8_model(cfg, config, "cpu")
    weights = model.weights()
    fp8 = {n for n, t in weights.items() if t.dtype == torch.float8_e4m3fn}
    kept = {n for n in weights if n.endswith(RELEASED_BF16["glm5"])}
    assert kept and fp8 == bench_model.linear_map_names(cfg) & weights.keys() - kept
    assert all(weights[n].dtype == torch.float32 for n in kept)  # (transformers keeps weights_proj in fp32)
    bench_model.add_lora(model, rank=4)
    model.use_ops(ops.resolve("all"))
    ids = torch.randint(0, cfg.vocab_size, (1, 96), generator=torch.Generator().manual_seed(4))
    batch = Packed.from_rows(ids)
    loss = model.loss(batch, batch.num_targets)
    loss.backward()
    assert torch.isfinite(loss)
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    assert trained and all("lora_" in n for n in trained)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trained


def test_peak_breakdown_names_what_is_alive_at_the_peak():
    # A hand-made allocator trace (the field names of torch.cuda.memory._snapshot()): the peak is
    # after event 3 (a 100 + b 300 + c 50 - the base block's 40 freed = 410 bytes), before b's free.
    fwd = [{"filename": "/r/py/v4train/model.py", "line": 7, "name": "loss"}]
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": fwd},
        {"action": "free_completed", "addr": 99, "size": 40, "frames": []},  # allocated before the recording
        {"action": "alloc", "addr": 2, "size": 300, "frames": []},
        {"action": "alloc", "addr": 3, "size": 50, "frames": fwd},
        {"action": "free_requested", "addr": 2, "size": 300, "frames": []},
        {"action": "free_completed", "addr": 2, "size": 300, "frames": []},
        {"action": "alloc", "addr": 4, "size": 200, "frames": fwd},
    ]
    peak, rows = bench_model.peak_breakdown(trace, tokens=10)
    assert peak == 410
    assert [(r["where"], r["block_bytes"], r["count"], r["bytes"]) for r in rows] == [
        ("(autograd backward)", 300, 1, 300), ("model.py:7 loss", 100, 1, 100), ("model.py:7 loss", 50, 1, 50)]
    assert rows[0]["bytes_per_token"] == 30


def test_the_fp8_probe_rounds_activations_to_e4m3_in_blocks_of_128():
    """tools/fp8_activation_probe.py's rounding, against values worked by hand: e4m3 keeps 3
    fraction bits (1.0625, halfway from 1 to 1.125, goes to the even 1; 3.3 to 3.25), each block
    of 128 scaled by its amax / 448; an all-zero block stays zeros. The backward rounds dy only
    where asked."""
    import fp8_activation_probe as probe

    x = torch.zeros(2, 256)
    x[0, 0], x[0, 1], x[0, 2] = 448.0, 1.0625, 3.3  # block 0: scale 1
    x[0, 128], x[0, 129] = 896.0, 3.3  # block 1: scale 2, 3.3 / 2 = 1.65 -> 1.625
    y = probe.e4m3_rows(x)
    assert y[0, :3].tolist() == [448.0, 1.0, 3.25]
    assert y[0, 128:130].tolist() == [896.0, 3.25]
    assert torch.count_nonzero(y[0, 3:128]) == 0 and torch.count_nonzero(y[1]) == 0
    w = torch.eye(256)[:4]  # picks columns 0..3 of x; dy W puts dy in those columns
    xg = x.clone().requires_grad_()
    dy = torch.tensor([[448.0, 1.0625, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    out = probe.E4m3Product.apply(xg, w, True, True)
    assert out[0].tolist() == [448.0, 1.0, 3.25, 0.0]
    (g,) = torch.autograd.grad(out, xg, dy)
    assert g[0, :2].tolist() == [448.0, 1.0]
    (g,) = torch.autograd.grad(probe.E4m3Product.apply(xg, w, True, False), xg, dy)
    assert g[0, :2].tolist() == [448.0, 1.0625]
    out = probe.E4m3Product.apply(xg, w, False, True)  # the backward alone rounded
    assert out[0].tolist() == x[0, :4].tolist()  # x as it is
    (g,) = torch.autograd.grad(out, xg, dy)
    assert g[0, :2].tolist() == [448.0, 1.0]


def test_the_fp8_probe_puts_the_reference_back():
    import fp8_activation_probe as probe
    from v4train.models.glm5 import attention
    from v4train.reference import lora, mlp, moe

    before = attention.linear, mlp.linear, lora.linear, moe._grouped
    try:
        probe.emulate("dense_fwd")
        assert attention.linear is not before[0] and mlp.linear is not before[1] and moe._grouped is before[3]
        probe.emulate("experts_fwd_bwd")
        assert moe._grouped is not before[3] and attention.linear is before[0]
        probe.emulate("dense_bwd")
        assert attention.linear is not before[0] and moe._grouped is before[3]
        probe.emulate("none")
        assert (attention.linear, mlp.linear, lora.linear, moe._grouped) == before
    finally:
        probe.emulate("none")


def test_kernel_names_drop_what_varies_between_launches_of_one_kernel():
    assert bench_model.kernel_name("void v4::cuda::(anonymous namespace)::fp8_e4m3_kernel<false, 256>(CUtensorMap_st, "
                                   "E4m3Args)") == "v4::cuda::fp8_e4m3_kernel"
    assert bench_model.kernel_name("v4::cuda::(anonymous namespace)::quantize_rows_kernel(__nv_bfloat16 const*, "
                                   "long)") == "v4::cuda::quantize_rows_kernel"
    assert bench_model.kernel_name("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == \
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT"


def test_the_kernel_diff_leads_with_the_largest_differences_either_way():
    bf16 = {"cutlass_grouped": 21.6, "nvjet": 30.0, "elementwise": 5.0}
    fp8 = {"fp8_e4m3_kernel": 17.8, "nvjet": 30.1, "elementwise": 5.0, "dequantize_kernel": 2.6}
    lines = bench_model.kernel_diff(bf16, fp8, ("bf16", "fp8"), top=3).splitlines()
    assert lines[0] == "| kernel | bf16 ms | fp8 ms | difference |"
    assert [line.split(" | ")[0] for line in lines[2:5]] == ["| cutlass_grouped", "| fp8_e4m3_kernel",
                                                              "| dequantize_kernel"]
    assert lines[2] == "| cutlass_grouped | 21.60 | 0.00 | -21.60 |"
    assert lines[-1] == "| all kernels | 56.60 | 55.50 | -1.10 |"
