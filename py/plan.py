"""//py:plan: the memory one GPU needs to train a model, and the longest --seq_len that fits.

    tools/bazel run //py:plan -- --model_dir=testdata/released/GLM-5-FP8 --gpus=8 --expert_parallel=8 \\
        --finetune=lora --seq_len=4096 --micro_batch_size=1 --gradient_checkpointing

--model_dir reads DIR/config.json (no weights are read), --model_config a config.json. The flags
the trainer has (--seq_len, --micro_batch_size, --finetune, --fp8, --lora_r, --lora_target_modules,
--lora_experts, --gradient_checkpointing, --dtype) are the trainer's own, so a --flagfile of
//py:train plans that run (--expert_parallel too); --gpus and --gpu_memory_gib are the planner's.
Prints per GPU: weights by dtype, what trains (LoRA factors or weights, gradients, AdamW's
state), the activation peak and where it is, the communication buffers, the headroom, the
longest --seq_len that fits; the last line is one JSON object with the same numbers (bytes).
How it counts, and what it leaves out: v4train/plan.py and docs/distributed.md.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import sys

from absl import flags

from v4train import cli
import v4train.flags  # noqa: F401  (defines the trainer's flags, which the plan reads)
from v4train import plan
from v4train.hf_checkpoint import read_config
from v4train.models.config import ConfigError

FLAGS = flags.FLAGS
REUSED = ("model_dir", "model_config", "seq_len", "micro_batch_size", "finetune", "fp8", "lora_r",
          "lora_target_modules", "lora_experts", "gradient_checkpointing", "dtype", "expert_parallel")
for _name in REUSED:
    flags.declare_key_flag(_name)  # listed by --help beside the planner's own
flags.DEFINE_integer("gpus", 1, "GPUs the run uses (the world size).", lower_bound=1)
flags.DEFINE_float("gpu_memory_gib", plan.H200_USABLE_GIB,
                   "Memory of one GPU that PyTorch can allocate, GiB (default: an H200's).", lower_bound=0.0)
GIB = plan.GIB
TERMS_SHOWN = 8  # the largest tensors at the peak that the report lists


def config_path() -> tuple[str, str]:
    """(the config.json to read, the flag that named it)."""
    if bool(FLAGS.model_dir) == bool(FLAGS.model_config):
        raise ValueError("give exactly one of --model_dir (a checkpoint directory: its config.json) and --model_config "
                         "(a config.json)")
    if FLAGS.model_dir:
        directory = cli.input_path("model_dir", FLAGS.model_dir, directory=True)
        path = os.path.join(directory, "config.json")
        if not os.path.exists(path):
            raise ValueError(f"--model_dir={FLAGS.model_dir}: {path} not found (expected a Hugging Face checkpoint "
                             "directory with its config.json)")
        return path, "--model_dir"
    return cli.input_path("model_config", FLAGS.model_config), "--model_config"


def setup_from_flags() -> plan.Setup:
    path, flag = config_path()
    try:
        hf_config, cfg = read_config(path)
    except ConfigError as e:
        raise ValueError(f"{flag}: {e}") from None
    return plan.Setup(cfg, hf_config, gpus=FLAGS.gpus, expert_parallel=FLAGS.expert_parallel,
                      finetune=FLAGS.finetune, fp8=FLAGS.fp8, seq_len=FLAGS.seq_len,
                      micro_batch_size=FLAGS.micro_batch_size, lora_r=FLAGS.lora_r,
                      lora_target_modules=tuple(FLAGS.lora_target_modules), lora_experts=FLAGS.lora_experts,
                      checkpointing=FLAGS.gradient_checkpointing,
                      dtype_bytes={"bfloat16": 2, "float32": 4}[FLAGS.dtype], gpu_memory_gib=FLAGS.gpu_memory_gib)


def gib(n: int) -> str:
    return f"{n / GIB:9.2f}"


def report(p: plan.Plan, longest: int, longest_ckpt: int | None) -> tuple[list[str], dict]:
    """The lines to print, and the JSON object."""
    s, cfg = p.setup, p.setup.cfg
    by_dtype = collections.Counter()
    for w in p.weights:
        by_dtype[w.dtype] += w.bytes - w.scale_bytes
        by_dtype["float32 FP8 scales"] += w.scale_bytes
    experts = sum(w.bytes for w in p.weights if w.expert)
    q = plan.fp8_config(s.hf_config)
    fp8_note = ("FP8 kept (the config's quantization_config: 128 x 128 blocks)" if q and s.fp8 == "keep" else
                "FP8 dequantised (--fp8=dequantize)" if q else "no FP8 quantization_config: weights in --dtype")
    t = p.training
    lines = [
        f"{cfg.model_type}, {cfg.num_hidden_layers} layers, {count(sum(_numel(w) for w in p.weights))} weights "
        f"(per GPU below): --finetune={s.finetune}" + (f" --lora_r={s.lora_r}" if s.finetune == "lora" else "") +
        f", {s.gpus} GPU(s), expert parallel {s.expert_parallel}, {s.tokens:,} tokens a GPU ({s.micro_batch_size} x "
        f"{s.seq_len:,}), checkpointing {'on' if s.checkpointing else 'off'}; {fp8_note}",
        "",
        f"weights                                           {gib(p.weight_bytes)} GiB",
        *(f"  {k:48s}{gib(v)}" for k, v in sorted(by_dtype.items()) if v),
        f"  (routed experts {experts / GIB:.2f} GiB: 1/{s.expert_parallel} of each layer's on each GPU; every other "
        f"weight FSDP2-sharded over {s.gpus} GPU(s))",
        f"{'LoRA factors' if s.finetune == 'lora' else 'training state'}: {t.count:,} trained values here",
        *(f"  {k:48s}{gib(v)}" for k, v in (("parameters", t.parameters), ("gradients", t.gradients),
                                             ("AdamW moments (fp32)", t.moments),
                                             ("fp32 master weights", t.masters)) if v),
        f"activations at the peak                           {gib(p.peak.bytes)} GiB",
        f"  where: {p.peak.where}",
        *(f"  {gib(x.bytes)}  {x.what}" for x in sorted(p.peak.terms, key=lambda x: -x.bytes)[:TERMS_SHOWN]),
        f"communication buffers                             {gib(p.comm.bytes)} GiB",
        f"  {'(all-to-all of the routed rows, both ways:':48s}{gib(p.comm.all_to_all)} in the activations)",
        f"  {'FSDP2 all-gather (2 layers and the root)':48s}{gib(p.comm.all_gather)}",
        f"  {'FSDP2 reduce-scatter (one layer)':48s}{gib(p.comm.reduce_scatter)}",
        f"total                                             {gib(p.total_bytes)} GiB of {s.gpu_memory_gib:.1f}",
        f"headroom                                          {gib(p.headroom_bytes)} GiB: "
        + ("fits" if p.fits else "does NOT fit"),
        f"longest --seq_len that fits (steps of {plan.SEQ_LEN_STEP}, --micro_batch_size={s.micro_batch_size}): "
        + (f"{longest:,}" if longest else "none"),
    ]
    if longest_ckpt is not None:
        lines.append(f"  with --gradient_checkpointing: {longest_ckpt:,}" if longest_ckpt else
                     "  with --gradient_checkpointing: none")
    result = {
        "model_type": cfg.model_type, "layers": cfg.num_hidden_layers, "gpus": s.gpus,
        "expert_parallel": s.expert_parallel,
        "finetune": s.finetune, "fp8": "keep" if q and s.fp8 == "keep" else "none" if not q else "dequantize",
        "seq_len": s.seq_len, "micro_batch_size": s.micro_batch_size, "tokens_per_gpu": s.tokens,
        "gradient_checkpointing": s.checkpointing, "weight_bytes": p.weight_bytes,
        "weight_bytes_by_dtype": {k: v for k, v in by_dtype.items() if v}, "expert_weight_bytes": experts,
        "training_bytes": dataclasses.asdict(t) | {"total": p.state_bytes}, "activation_bytes": p.peak.bytes,
        "activation_peak": p.peak.where, "communication_bytes": dataclasses.asdict(p.comm) | {"total": p.comm.bytes},
        "total_bytes": p.total_bytes, "gpu_memory_bytes": int(s.gpu_memory_gib * GIB),
        "headroom_bytes": p.headroom_bytes,
        "fits": p.fits, "longest_seq_len": longest, "seq_len_step": plan.SEQ_LEN_STEP,
    }
    if longest_ckpt is not None:
        result["longest_seq_len_with_checkpointing"] = longest_ckpt
    return lines, result


def count(n: int) -> str:
    """1.2M, 743.9B."""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _numel(w: plan.WeightLine) -> int:
    n = 1
    for d in w.shape:
        n *= d
    return n


def main(argv):
    from absl import app

    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        setup = setup_from_flags()
        p = plan.plan(setup)
        longest = plan.longest_seq_len(setup)
        longest_ckpt = None if setup.checkpointing else \
            plan.longest_seq_len(dataclasses.replace(setup, checkpointing=True))
    except ValueError as e:  # PlanError, ConfigError and a path not found are ValueErrors, each naming its flag
        print(f"plan: {e}", file=sys.stderr)
        return 2
    lines, result = report(p, longest, longest_ckpt)
    print("\n".join(lines))
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    cli.run_app("plan", main, sys.argv)
