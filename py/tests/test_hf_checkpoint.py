"""Reading and writing Hugging Face checkpoints: round trips through transformers, errors."""

import json
import os
import re
import shutil

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from golden_cases import golden
from v4train.testing.compare import assert_rel_close
from v4train import hf_checkpoint
from v4train.reference.lora import dequantize_fp8
from v4train.model import CausalLM, Packed
from v4train.models import load_config
from v4train.models.config import ConfigError


@pytest.mark.parametrize("case", ["glm5", "qwen3_5_moe_vl", "qwen3_5"])
def test_saved_checkpoint_loads_in_transformers_with_the_same_logits(case, tmp_path):
    import transformers

    model_dir, tensors, _ = golden(case)
    model, _ = hf_checkpoint.load(model_dir)
    with torch.no_grad():  # train it a little, so that the saved weights are v4train's own
        for name, w in model.named_parameters():
            w.add_(torch.randn_like(w) * 0.01)
    out = tmp_path / "saved"
    hf_checkpoint.save(model, str(out))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, attn_implementation="eager")
    ids = tensors["input_ids"]
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
        ours = model.logits(Packed.from_rows(ids)).reshape(theirs.shape)
    assert_rel_close(ours, theirs, f"{case}: transformers on v4train's checkpoint")


def test_sharded_save_writes_an_index_and_reads_back_identically(tmp_path):
    model, _ = hf_checkpoint.load(golden("glm5")[0], torch.bfloat16)  # (its router in float32: two dtypes)
    hf_checkpoint.save(model, str(tmp_path / "out"), max_shard_bytes=200_000)
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    for shard in shards:
        tensors = load_file(str(out / shard))
        assert sum(t.numel() * t.element_size() for t in tensors.values()) <= 200_000
        assert all(index["weight_map"][k] == shard for k in tensors)
    again, _ = hf_checkpoint.load(str(tmp_path / "out"), torch.bfloat16)
    assert all(torch.equal(again.get_parameter(k), v) for k, v in model.weights().items())
    import transformers  # the weights' dtype, not the float32 base's: what dtype="auto" loads them in

    assert transformers.AutoConfig.from_pretrained(golden("glm5")[0]).dtype == torch.float32
    assert transformers.AutoConfig.from_pretrained(str(out)).dtype == torch.bfloat16


def test_save_is_atomic_and_replaces_the_old_checkpoint(tmp_path, monkeypatch):
    model, _ = hf_checkpoint.load(golden("qwen3_5")[0])
    out = tmp_path / "ckpt"
    hf_checkpoint.save(model, str(out))
    before = load_file(str(out / "model.safetensors"))

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(hf_checkpoint, "_write_file", broken)
    with pytest.raises(OSError, match="disk full"):
        hf_checkpoint.save(model, str(out))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"], "no temporary folder is left behind"
    after = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_empty_model_is_on_the_meta_device():
    model_dir, _, _ = golden("glm5")
    cfg = load_config(model_dir)
    model = CausalLM.empty(cfg, {})
    assert all(w.device.type == "meta" for w in model.parameters())


def _copy(case, tmp_path):
    dst = tmp_path / case
    shutil.copytree(golden(case)[0], dst)
    return dst


def _edit(path, fn):
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))


def test_missing_unexpected_and_misshaped_tensors_are_all_listed(tmp_path):
    d = _copy("glm5", tmp_path)

    def damage(t):
        del t["model.layers.0.self_attn.o_proj.weight"]
        del t["model.layers.2.mlp.experts.5.up_proj.weight"]
        t["model.layers.1.surprise.weight"] = torch.zeros(2)
        t["model.norm.weight"] = torch.zeros(3)

    _edit(d / "model.safetensors", damage)
    with pytest.raises(hf_checkpoint.CheckpointError) as info:
        hf_checkpoint.load(str(d))
    msg = str(info.value)
    assert "missing tensor model.layers.0.self_attn.o_proj.weight [64, 64]" in msg
    assert "missing tensor model.layers.2.mlp.experts.5.up_proj.weight" in msg
    assert "unexpected tensor model.layers.1.surprise.weight" in msg
    assert "model.norm.weight: shape [3], expected [64]" in msg


def test_truncated_file_is_named(tmp_path):
    d = _copy("qwen3_5_moe_sharded", tmp_path)
    shard = d / "model-00003-of-00022.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(hf_checkpoint.CheckpointError, match="model-00003-of-00022.safetensors.*truncated"):
        hf_checkpoint.load(str(d))


def test_unknown_model_type_and_missing_files(tmp_path):
    d = _copy("qwen3_5", tmp_path)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(config, model_type="llama")))
    with pytest.raises(ConfigError, match="model_type='llama' is not supported"):
        hf_checkpoint.load(str(d))
    (d / "config.json").write_text(json.dumps(config))
    os.remove(d / "model.safetensors")
    with pytest.raises(hf_checkpoint.CheckpointError, match="neither model.safetensors nor model.safetensors.index.json"):
        hf_checkpoint.load(str(d))
    with pytest.raises(ConfigError, match="config.json: not found"):
        hf_checkpoint.load(str(tmp_path / "nowhere"))


def test_fp8_weights_are_dequantised_per_block(tmp_path):
    w = torch.randn(200, 300)
    q = (w / 2).to(torch.float8_e4m3fn)
    scale = torch.tensor([[2.0, 3.0, 4.0], [5.0, 6.0, 7.0]])
    out = dequantize_fp8(q, scale, torch.float32)  # what the loader and the C++ ops' FP8 path compute
    assert torch.equal(out[:128, :128], q[:128, :128].float() * 2)
    assert torch.equal(out[128:, 256:], q[128:, 256:].float() * 7)


# What Qwen3.5's released FP8 checkpoints quantise (docs/models.md): the Gated DeltaNet and
# attention projections but in_proj_a / in_proj_b, the shared and the routed experts.
QWEN_FP8 = ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.out_proj.weight",
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
            "gate_proj.weight", "up_proj.weight", "down_proj.weight")


def test_a_qwen3_5_fp8_checkpoint_stays_fp8_and_trains_lora_as_dequantised(tmp_path):
    """The Qwen3.5 base quantised as its released FP8 checkpoints are: --fp8=keep keeps its
    projections FP8 (the packed experts dequantised: their 64-row parts do not fill the 128-row
    scale blocks), and the C++ layers give the loss and LoRA gradients of the base dequantised
    on load."""
    from golden_cases import QWEN_BASE, copy_model
    from v4train import lora, ops
    from v4train.reference.lora import quantize_fp8, scale_name
    from v4train.testing.compare import assert_close

    def quantise(t):
        for name in [n for n in t if n.endswith(QWEN_FP8)]:
            t[name], t[scale_name(name)] = quantize_fp8(t[name])
    model_dir = copy_model(tmp_path, tensors=quantise, base=QWEN_BASE)
    kept, _ = hf_checkpoint.load(model_dir, torch.float32, fp8="keep")
    dense, _ = hf_checkpoint.load(model_dir, torch.float32, fp8="dequantize")
    dtypes = {n: p.dtype for n, p in kept.named_parameters()}
    fp8 = {n for n, d in dtypes.items() if d == torch.float8_e4m3fn}
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in fp8 and "model.layers.3.self_attn.o_proj.weight" in fp8
    assert "model.layers.0.mlp.shared_expert.down_proj.weight" in fp8
    assert dtypes["model.layers.0.linear_attn.in_proj_a.weight"] == torch.float32
    assert dtypes["model.layers.0.mlp.experts.gate_up_proj"] == torch.float32
    batch = Packed.from_documents([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [3, 4, 5]])
    grads = []
    for model in (kept, dense):
        model.use_ops(ops.resolve("all"))
        lcfg = lora.LoraConfig(r=2, alpha=4, dropout=0.0, target_modules=lora.expand_targets(model, ["attention"]),
                               experts=True)
        adapters = lora.add_adapters(model, lcfg, torch.float32, "cpu", seed=0)
        with torch.no_grad():
            for n, t in adapters.items():
                if n.endswith("lora_B"):
                    t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
        loss = model.loss(batch)
        loss.backward()
        grads.append((loss.detach(), {n: t.grad for n, t in adapters.items()}))
    assert_close(grads[0][0], grads[1][0], "loss")
    assert grads[0][1].keys() == grads[1][1].keys() and any("linear_attn" in n for n in grads[0][1])
    for n, g in grads[1][1].items():
        assert_close(grads[0][1][n], g, f"gradient of {n}")


def test_only_linear_maps_stay_fp8_a_router_in_fp8_is_dequantised(tmp_path):
    """--fp8=keep keeps a layer's linear maps in FP8; an FP8 router (a plain tensor to the ops,
    which would take it without its scales) is dequantised on load: the same loss either way."""
    from golden_cases import copy_model
    from v4train.reference.lora import quantize_fp8, scale_name

    def quantise(t):
        for name in [n for n in t if n.endswith(("mlp.gate.weight", "self_attn.q_a_proj.weight"))]:
            t[name], t[scale_name(name)] = quantize_fp8(t[name])
    model_dir = copy_model(tmp_path, tensors=quantise)
    kept, _ = hf_checkpoint.load(model_dir, torch.float32, fp8="keep")
    dense, _ = hf_checkpoint.load(model_dir, torch.float32, fp8="dequantize")
    params = dict(kept.named_parameters())
    routers = [n for n in params if n.endswith("mlp.gate.weight")]
    assert routers and all(params[n].dtype == torch.float32 for n in routers)
    assert params["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.float8_e4m3fn
    batch = Packed.from_documents([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [3, 4, 5]])
    assert torch.equal(kept.loss(batch), dense.loss(batch))
    with pytest.raises(ValueError, match="only a layer's linear maps can stay FP8"):
        tensors = {**{n: p.detach() for n, p in kept.named_parameters()}}
        tensors[routers[0]], tensors[scale_name(routers[0])] = quantize_fp8(tensors[routers[0]])
        CausalLM(kept.cfg, tensors, kept.hf_config)


def _recording(reads: list):
    """hf_checkpoint._open that notes each read in `reads`: (key, None) for a whole tensor,
    (key, (start, stop)) for a range of its rows."""
    opened = hf_checkpoint._open

    def recording(path):
        handle = opened(path)

        class Slice:  # safe_open's slice of one tensor, its reads noted
            def __init__(self, key):
                self.key, self.slice = key, handle.get_slice(key)

            def __getattr__(self, name):
                return getattr(self.slice, name)

            def __getitem__(self, rows):
                reads.append((self.key, (rows.start, rows.stop)))
                return self.slice[rows]

        class Recorder:  # safe_open's handle, its reads noted
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def __getattr__(self, name):
                return getattr(handle, name)

            def get_tensor(self, key):
                reads.append((key, None))
                return handle.get_tensor(key)

            def get_slice(self, key):
                return Slice(key)
        return Recorder()
    return recording


def _base(name: str) -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "testdata", name)


@pytest.mark.parametrize("base", ["glm5_base", "qwen3_5_base"])
def test_an_expert_parallel_rank_reads_only_its_experts(base, monkeypatch):
    """experts=(4, 8): every MoE layer's packed experts are rows 4..7 of the whole load's, every
    other tensor equal, and no tensor of experts 0..3 is read (nor reported as unexpected)."""
    model_dir = _base(base)
    whole, _ = hf_checkpoint.load(model_dir)
    reads = []
    monkeypatch.setattr(hf_checkpoint, "_open", _recording(reads))
    part, _ = hf_checkpoint.load(model_dir, experts=(4, 8))
    packed = [n for n in whole.weights() if ".mlp.experts." in n]
    assert packed
    for name, t in whole.weights().items():
        assert torch.equal(part.weights()[name], t[4:8] if name in packed else t), name
    assert reads and not [k for k, _ in reads if any(f".experts.{e}." in k for e in range(4))]


def _fp8_base(tmp_path, base: str) -> str:
    """The bundled base with FP8 weights of each kind a rank reads rows of: linear maps (kept in
    FP8 by --fp8=keep), the embedding (always dequantised; its 384 rows split at 192, inside a
    128-row scale block) and layer 1's routed experts stored packed, [E, ...] with [E, 1, 1] scales."""
    from golden_cases import copy_model
    from v4train.reference.lora import quantize_fp8, scale_name

    def quantise(t):
        for name in [n for n in t if n.endswith(("o_proj.weight", "kv_b_proj.weight", "in_proj_qkv.weight",
                                                  "shared_expert.up_proj.weight", "embed_tokens.weight"))]:
            t[name], t[scale_name(name)] = quantize_fp8(t[name])
        prefix = "model.layers.1.mlp.experts."
        for packed, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            w = torch.stack([torch.cat([t.pop(f"{prefix}{e}.{p}.weight") for p in parts]) for e in range(8)])
            t[prefix + packed], t[scale_name(prefix + packed)] = quantize_fp8(w)
    return copy_model(tmp_path, tensors=quantise, base=_base(base))


def _needed_rows(key: str, shapes: dict, rank: int, size: int, kept: set[str]) -> set[int]:
    """The rows of checkpoint tensor `key` that rank `rank` of `size` needs for its FSDP2 shards
    (torch.chunk's split of dim 0); the scale of an [out, in] weight dequantised on load (not in
    `kept`): the 128-row blocks over the weight's rows; a per-expert tensor: all its rows if the
    rank's shard holds the expert."""
    def chunk(n):
        parts = torch.arange(n).chunk(size)
        return set(parts[rank].tolist()) if rank < len(parts) else set()
    expert = re.search(r"\.experts\.(\d+)\.", key)
    if expert:
        return set(range(shapes[key][0])) if int(expert.group(1)) in chunk(8) else set()
    weight = key.removesuffix("_scale_inv")
    if weight != key and weight not in kept and len(shapes[weight]) == 2:
        return {r // 128 for r in chunk(shapes[weight][0])}
    return chunk(shapes[key][0])


def _sharded_load_worker(rank: int, size: int, init: str, model_dir: str) -> None:
    from golden_cases import gloo
    from safetensors import safe_open
    from v4train import distributed

    with gloo(rank, size, init), safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
        opened = hf_checkpoint._open
        for fp8 in ("keep", "dequantize"):
            hf_checkpoint._open = opened
            whole, _ = hf_checkpoint.load(model_dir, fp8=fp8)
            reads = []
            hf_checkpoint._open = _recording(reads)  # (this process's own module)
            model, report = hf_checkpoint.load(model_dir, fp8=fp8, shard=(rank, size))
            distributed.shard(model, distributed.World(rank, size, rank, dist.group.WORLD.group_name))
            distributed.fill_shards(model, report["rows"])
            params = dict(model.named_parameters())
            assert sorted(params) == sorted(n for n, _ in whole.named_parameters())
            for name, t in whole.named_parameters():
                shards = [None] * size  # FSDP2's shards, gathered as bytes (gloo gathers no float8)
                dist.all_gather_object(shards, params[name].to_local().detach().view(torch.uint8))
                assert params[name].dtype == t.dtype and torch.equal(torch.cat(shards), t.detach().view(torch.uint8)), \
                    f"--fp8={fp8}: {name}"
            kept = {n for n, t in whole.named_parameters() if t.dtype == torch.float8_e4m3fn}
            assert kept if fp8 == "keep" else not kept
            for key, rows in reads:
                read = set(range(*rows) if rows else range(shapes[key][0]))
                extra = read - _needed_rows(key, shapes, rank, size, kept)
                assert not extra, f"--fp8={fp8}: rank {rank} read rows {min(extra)}..{max(extra)} of {key}, " \
                    "another rank's"
            per_expert = re.compile(r"\.experts\.\d+\.")
            assert {k for k, rows in reads if rows} >= {k for k in shapes if not per_expert.search(k)}


@pytest.mark.parametrize("base", ["glm5_base", "qwen3_5_base"])
def test_a_rank_of_two_fsdp2_processes_reads_only_its_rows(base, tmp_path):
    """Two gloo processes load the base (FP8 weights of each kind among its tensors, kept or
    dequantised) with shard=(rank, 2), FSDP2 shards the model and each fills its shards: gathered,
    every tensor equals one process's whole load, and no rank read a row that only another rank's
    shard holds (a dequantised weight reads the scale blocks over its rows; the embedding's split
    falls inside a block)."""
    import torch.multiprocessing as mp

    model_dir = _fp8_base(tmp_path, base)
    mp.spawn(_sharded_load_worker, args=(2, str(tmp_path / "init"), model_dir), nprocs=2, join=True)
