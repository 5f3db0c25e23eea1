"""The random base of --model_config (v4train.random_init): drawn as the loader makes an FP8
checkpoint of the same config, each rank of a sharded run drawing only its part, reproducible; the
trainer's refusals; a LoRA run over two processes writing its base gathered."""

import json
import math
import os
import re

import pytest
import torch
import torch.distributed as dist

from golden_cases import assert_each_rank_drew_its_part, gloo, golden, metrics, run_cli, small_glm5_fp8
from v4train import distributed, hf_checkpoint, lora, ops, plan, random_init
from v4train.flags import FlagError
from v4train.model import Packed, all_specs, linear_map_names
from v4train.models import config_from_dict
from v4train.models.config import ConfigError
from v4train.reference.lora import FP8_MAX, dequantize_fp8, quantize_fp8, scale_name
from v4train.trainer import RunConfig, Trainer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """t's bits, for exact comparisons that float8 tensors do not support."""
    return t.detach().contiguous().view(torch.uint8)


def layout(model) -> dict:
    return {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}


def _released_fp8_checkpoint(tmp_path, hf_config: dict) -> str:
    """A model of hf_config written as its FP8 release is: transformers' keys, every weight that the
    quantization_config does not leave out a linear map of FP8 with its 128 x 128 scales."""
    from safetensors.torch import save_file

    cfg = config_from_dict(hf_config, "config")
    model, _ = random_init.draw(cfg, hf_config, torch.float32, fp8="dequantize", seed=3)
    maps, q, tensors = linear_map_names(cfg), hf_config["quantization_config"], {}
    for spec in all_specs(cfg):
        for key, part in hf_checkpoint._hf_tensors(spec, model.get_parameter(spec.name).detach()):
            if spec.name in maps and not plan.not_converted(key, q):
                tensors[key], tensors[scale_name(key)] = quantize_fp8(part)
            else:
                tensors[key] = part.contiguous()
    d = tmp_path / "released"
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(hf_config))
    return str(d)


@pytest.mark.parametrize("fp8", ["keep", "dequantize"])
def test_the_random_base_is_laid_out_as_the_loader_makes_the_release(fp8, tmp_path):
    """Every tensor of the drawn base has the name, shape and dtype that hf_checkpoint.load gives
    an FP8 checkpoint of the same config (the released GLM-5's, shrunk): with --fp8=keep its
    quantised linear maps float8 beside fp32 scales (the router, the indexer's weights_proj, the
    embeddings and LM head not), with --fp8=dequantize everything in --dtype (fp32 where kept so)."""
    hf_config = small_glm5_fp8()
    loaded, _ = hf_checkpoint.load(_released_fp8_checkpoint(tmp_path, hf_config), torch.bfloat16, fp8=fp8)
    drawn, report = random_init.draw(loaded.cfg, hf_config, torch.bfloat16, fp8=fp8)
    assert report == {}
    assert layout(drawn) == layout(loaded)
    fp8_names = [n for n, p in drawn.named_parameters() if p.dtype == torch.float8_e4m3fn]
    assert bool(fp8_names) == (fp8 == "keep")
    for name in fp8_names:  # the scales of a normal(0, 0.02) init: its 4-sigma value at 448
        w, s = drawn.get_parameter(name), drawn.get_parameter(scale_name(name))
        assert torch.all(s == random_init.FP8_SCALE), name
        std = dequantize_fp8(w, s, torch.float32).std().item()
        assert abs(std - 0.02) < 0.002, (name, std)
        assert (w.float().abs() == FP8_MAX).float().mean() < 1e-3, name  # few values clamped


def test_one_seed_draws_one_base_and_another_seed_another():
    hf_config = small_glm5_fp8()
    cfg = config_from_dict(hf_config, "config")
    a, b, c = (random_init.draw(cfg, hf_config, torch.bfloat16, seed=s)[0] for s in (0, 0, 1))
    assert all(torch.equal(as_bytes(p), as_bytes(b.get_parameter(n))) for n, p in a.named_parameters())
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert not torch.equal(as_bytes(a.get_parameter(name)), as_bytes(c.get_parameter(name)))
    # Any rows alone are those rows of the whole (what lets each rank draw its own part).
    spec = next(s for s in all_specs(cfg) if s.name == "model.embed_tokens.weight")
    whole = random_init.draw_rows(spec, (0, spec.shape[0]), "cpu", 0)
    assert torch.equal(random_init.draw_rows(spec, (100, 300), "cpu", 0), whole[100:300])
    assert abs(whole.std().item() - 0.02) < 0.001 and abs(whole.mean().item()) < 0.001


def _drawing(log: list):
    """random_init.draw_rows that notes (tensor, rows, the tensor's rows) of each piece in `log`."""
    draw_rows = random_init.draw_rows

    def noted(spec, rows, device, seed):
        log.append((spec.name, tuple(rows), spec.shape[0]))
        return draw_rows(spec, rows, device, seed)
    return noted


def _two_ranks(rank: int, size: int, init: str, hf_config: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    with gloo(rank, size, init):
        cfg = config_from_dict(hf_config, "config")
        world = distributed.World(rank, size, rank, dist.group.WORLD.group_name, size,
                                  init_device_mesh("cpu", (1, size), mesh_dim_names=("dp", "ep")))
        log = []
        draw_rows, random_init.draw_rows = random_init.draw_rows, _drawing(log)
        try:
            model, report = random_init.draw(cfg, hf_config, torch.bfloat16, "cpu", "keep", 0,
                                             distributed.local_experts(cfg, world), world.shard)
        finally:
            random_init.draw_rows = draw_rows
        distributed.shard_experts(model, world)
        distributed.shard(model, world)
        distributed.fill_shards(model, report["rows"])
        drawn = [None] * size
        dist.all_gather_object(drawn, log)
        assert_each_rank_drew_its_part(drawn, cfg.n_routed_experts, size)
        one, _ = random_init.draw(cfg, hf_config, torch.bfloat16, "cpu", "keep", 0)  # one process's base
        assert layout(model) == layout(one)
        experts = distributed.local_experts(cfg, world)
        for name, p in model.named_parameters():  # the same base whatever the layout
            start, stop = experts if distributed.expert_tensor(name) else distributed.fsdp_rows(p.shape[0], rank, size)
            assert torch.equal(as_bytes(p.to_local()), as_bytes(one.get_parameter(name)[start:stop])), name
        model.use_ops(ops.resolve("all"))
        batch = Packed.from_documents([list(range(7 * rank, 7 * rank + 40))])
        assert math.isfinite(model.loss(batch, batch.num_targets).item())


def test_each_of_two_expert_parallel_ranks_draws_only_its_part(tmp_path):
    """Two gloo processes draw the shrunk released GLM-5 (FP8) with expert parallelism 2: each drew
    exactly its 4 experts of every MoE layer and its FSDP2 rows of every other tensor (draw_rows
    instrumented), every row once between them; FSDP2 takes the parts, which are one process's
    base, and the sharded model computes a finite loss."""
    import torch.multiprocessing as mp

    mp.spawn(_two_ranks, args=(2, str(tmp_path / "init"), small_glm5_fp8()), nprocs=2, join=True)


def _trainer(tmp_path, config: dict, **flags) -> Trainer:
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "data.jsonl").write_text(json.dumps({"input_ids": list(range(64))}) + "\n")
    return Trainer(RunConfig(data=str(tmp_path / "data.jsonl"), output_dir=str(tmp_path / "out"),
                             model_config=str(tmp_path / "config.json"), seq_len=64, max_steps=2, **flags))


@pytest.mark.parametrize("flags,message", [
    ({"finetune": "full"}, "--finetune=full: --model_config=.* has an FP8 quantization_config, so its random base is "
                           "drawn in FP8 .* pass --fp8=dequantize"),
    ({}, "--save_base_model: --model_config=.* has an FP8 quantization_config.* pass --nosave_base_model"),
    ({"save_base_model": False, "profile_step": 3}, "--profile_step=3 is past the last of the run's 2 steps"),
])
def test_what_a_random_fp8_base_cannot_do_is_refused_naming_the_flag(flags, message, tmp_path):
    with pytest.raises(FlagError, match=message):
        _trainer(tmp_path, small_glm5_fp8(), **flags)
    assert not (tmp_path / "out").exists()


def test_an_fp8_config_the_ops_cannot_take_is_refused_naming_the_file(tmp_path):
    config = small_glm5_fp8()
    config["quantization_config"] = dict(config["quantization_config"], weight_block_size=[64, 64])
    with pytest.raises(ConfigError, match=r"config.json: quantization_config.weight_block_size=\[64, 64\]"):
        _trainer(tmp_path, config, save_base_model=False)
    _trainer(tmp_path, small_glm5_fp8(), finetune="full", fp8="dequantize")  # drawn in --dtype: any training


def test_a_lora_run_over_two_processes_writes_its_random_base_gathered(tmp_path):
    """--model_config (no FP8), LoRA, 2 expert-parallel processes: base_model/ is the drawn base,
    gathered (one process's draw), and the adapter loads onto it."""
    config = os.path.join(REPO, "testdata", "sft", "glm5_config.json")
    out = tmp_path / "run"
    result = run_cli("train.py", f"--model_config={config}", "--data=" + os.path.join(REPO, "testdata", "sft",
                     "chat.jsonl"), "--tokenizer_dir=" + os.path.join(REPO, "testdata", "sft", "tokenizer"),
                     "--dtype=float32", "--seq_len=64", "--micro_batch_size=1", "--max_steps=1", "--noself_check",
                     "--device=cpu", "--nproc_per_node=2", "--expert_parallel=2", f"--output_dir={out}",
                     env={"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert math.isfinite(metrics(str(out))[0]["loss"])
    base, _ = hf_checkpoint.load(str(out / "base_model"))
    hf_config, cfg = hf_checkpoint.read_config(config)
    one, _ = random_init.draw(cfg, hf_config, torch.float32)
    for name, t in one.weights().items():
        assert torch.equal(base.get_parameter(name), t), name
    lora.load_peft(base, str(out / "checkpoint-1"), torch.float32, "cpu")
    assert re.fullmatch(r".*/base_model", json.loads((out / "checkpoint-1" / "adapter_config.json").read_text())
                        ["base_model_name_or_path"])


def test_adapters_of_an_unsaved_base_naming_a_folder_of_other_weights_are_said_so(tmp_path):
    """--nosave_base_model: the adapters name the config's folder; one holding a checkpoint would
    have peft load them onto those weights, not the random base they trained on (the QA pass)."""
    model_dir = golden("glm5")[0]
    (tmp_path / "data.jsonl").write_text(json.dumps({"input_ids": list(range(64))}) + "\n")
    result = run_cli("train.py", f"--model_config={model_dir}/config.json", "--nosave_base_model", "--max_steps=1",
                     f"--data={tmp_path / 'data.jsonl'}", "--seq_len=64", f"--output_dir={tmp_path / 'out'}",
                     "--dtype=float32")
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"--nosave_base_model: the adapters name {model_dir} (the config's folder) as their base, and it holds " \
           "weights other than the random base" in result.stderr
