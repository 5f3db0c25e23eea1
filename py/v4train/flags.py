"""Every flag of //py:train, with its help text (the documentation), and their validation.

Bad values stop the run before any work, with a message naming the flag.
"""

from __future__ import annotations

import math

from absl import flags

FLAGS = flags.FLAGS

# Model and data.
flags.DEFINE_string("model_dir", None, "Hugging Face checkpoint directory to fine-tune (config.json + safetensors; "
                    "its tokenizer files are used unless --tokenizer_dir says otherwise).")
flags.DEFINE_string("model_config", None, "A config.json to start from random weights instead of --model_dir, drawn "
                    "on the device, each process only what it keeps (its experts, its FSDP2 shard of the rest): no "
                    "file is read. In FP8 where the config's quantization_config is FP8 and --fp8=keep (float8 linear "
                    "maps with their 128x128 block scales, as an FP8 checkpoint loads: a frozen base for LoRA), else "
                    "in --dtype. --seed gives one base whatever the number of processes.")
flags.DEFINE_boolean("save_base_model", True, "With --model_config and LoRA: write the random base to "
                     "--output_dir/base_model before the first step, the base its adapters name (peft loads them onto "
                     "it). --nosave_base_model for a base too large to write (GLM-5's 744B) or an FP8 one (which "
                     "cannot be written): the adapters then name the config's folder, and a resume draws the same base "
                     "again from --seed.")
flags.DEFINE_string("tokenizer_dir", None, "Directory with tokenizer.json (+ tokenizer_config.json for the chat "
                    "template). Default: --model_dir, or the folder of --model_config.")
flags.DEFINE_string("data", None, "Training data: JSONL of messages, prompt/completion, text or input_ids records.")
flags.DEFINE_string("eval_data", None, "Evaluation data, same format; its mean loss is logged as eval_loss.")
flags.DEFINE_integer("eval_interval", 0, "Evaluate every this many optimizer steps (0: only at the end).", lower_bound=0)
flags.DEFINE_integer("seq_len", 1024, "Tokens per row: the packing length and the longest example.", lower_bound=2)
flags.DEFINE_enum("overlong", "truncate", ["truncate", "drop"], "What to do with examples longer than --seq_len.")
flags.DEFINE_boolean("packing", True, "Pack several examples into each row (document boundaries are kept).")

# Compute.
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Dtype of weights and activations.")
flags.DEFINE_enum("device", "auto", ["auto", "cpu", "cuda"], "Where to train; auto picks CUDA when available.")
flags.DEFINE_string("cpp_ops", "all", "Ops on the C++ path: 'all' (every op with a C++ implementation), 'none', "
                    "or a comma list of op names. The others run their PyTorch reference.")
flags.DEFINE_boolean("self_check", True, "Before training, compare each C++ op with its reference on small random "
                     "inputs of the run's dtype and device; stop on a mismatch.")
flags.DEFINE_boolean("gradient_checkpointing", False, "Recompute each layer's activations in the backward pass.")
flags.DEFINE_integer("profile_step", 0, "Profile this optimizer step on rank 0 with torch.profiler: its metrics row "
                     "gets the step's time split into compute and communication (collectives: NCCL kernels on the GPU, "
                     "gloo's ops on the CPU), and --output_dir/profile-stepN.json its Chrome trace. 0: no profile.",
                     lower_bound=0)

# Batch and schedule.
flags.DEFINE_integer("micro_batch_size", 4, "Rows per forward/backward pass.", lower_bound=1)
flags.DEFINE_integer("grad_accum", 1, "Micro-batches per optimizer step.", lower_bound=1)
flags.DEFINE_integer("max_steps", 0, "Optimizer steps to run (0: run --epochs).", lower_bound=0)
flags.DEFINE_float("epochs", 1.0, "Passes over the data when --max_steps is 0.", lower_bound=0.0)
flags.DEFINE_float("lr", 2e-4, "Peak learning rate.", lower_bound=0.0)
flags.DEFINE_float("min_lr", 0.0, "Learning rate at the end of the decay.", lower_bound=0.0)
flags.DEFINE_integer("warmup_steps", 0, "Linear warmup steps.", lower_bound=0)
flags.DEFINE_enum("lr_schedule", "cosine", ["cosine", "linear", "constant"], "Decay after warmup.")
flags.DEFINE_float("weight_decay", 0.0, "AdamW decoupled weight decay.", lower_bound=0.0)
flags.DEFINE_float("adam_beta1", 0.9, "AdamW beta1.", lower_bound=0.0, upper_bound=1.0)
flags.DEFINE_float("adam_beta2", 0.999, "AdamW beta2.", lower_bound=0.0, upper_bound=1.0)
flags.DEFINE_float("adam_eps", 1e-8, "AdamW epsilon.", lower_bound=0.0)
flags.DEFINE_float("max_grad_norm", 1.0, "Clip the global gradient norm to this (0: no clipping).", lower_bound=0.0)
flags.DEFINE_integer("seed", 0, "Seed of weight init, LoRA init, data order and dropout.")

# Fine-tuning mode.
flags.DEFINE_enum("finetune", "lora", ["lora", "full"], "LoRA adapters or all weights.")
flags.DEFINE_enum("fp8", "keep", ["keep", "dequantize"],
                  "An FP8 checkpoint's weights (float8_e4m3fn with 128x128-block weight_scale_inv): kept in FP8 on the "
                  "device, a frozen base the C++ ops dequantise as they use it (half the memory of bf16; LoRA only), or "
                  "dequantised into --dtype on load (needed for --finetune=full).")
flags.DEFINE_integer("lora_r", 16, "LoRA rank.", lower_bound=1)
flags.DEFINE_float("lora_alpha", 32.0, "LoRA alpha (the update is scaled by alpha / r).", lower_bound=0.0)
flags.DEFINE_float("lora_dropout", 0.0, "Dropout on the LoRA input.", lower_bound=0.0, upper_bound=1.0)
flags.DEFINE_list("lora_target_modules", ["attention"], "Modules to adapt, PEFT-style names (q_a_proj, o_proj, "
                  "mlp.gate_proj, shared_experts.up_proj, ...), 'attention' for every attention projection of "
                  "the model's family, or 'all-linear' for every linear map of the layers (not the routers, the "
                  "DSA indexer or the routed experts, which --lora_experts adapts).")
flags.DEFINE_boolean("lora_experts", True, "Adapt every routed expert (PEFT target_parameters "
                     "mlp.experts.gate_up_proj and mlp.experts.down_proj).")

# Output.
flags.DEFINE_string("output_dir", None, "Where checkpoints, metrics.jsonl and loss.png go.")
flags.DEFINE_integer("save_interval", 0, "Save a checkpoint every this many steps (0: only at the end).", lower_bound=0)
flags.DEFINE_integer("save_total_limit", 2, "Checkpoints to keep (the oldest are deleted).", lower_bound=1)
flags.DEFINE_string("resume_from", None, "'latest' (the newest checkpoint in --output_dir) or a checkpoint directory.")
flags.DEFINE_integer("log_interval", 1, "Log every this many steps; a row's loss is the mean over the steps since "
                     "the last row.", lower_bound=1)
flags.DEFINE_integer("stop_at_step", 0, "Save and stop after this step, as a preemption would (0: run to the end); "
                     "a later run with --resume_from=latest continues where it stopped.", lower_bound=0)
flags.DEFINE_boolean("overwrite_output_dir", False, "Start afresh in an --output_dir that holds an earlier run: its "
                     "checkpoints, metrics.jsonl and loss.png are deleted first (with --resume_from: the checkpoints "
                     "newer than the one resumed). Without it such a run stops before any work.")

# Many processes (docs/distributed.md).
flags.DEFINE_integer("nproc_per_node", 0, "Train with this many processes on this machine (one per GPU; on the CPU "
                     "gloo processes): the command starts torch's launcher, torch.distributed.run, with this many "
                     "copies of itself, data parallel with FSDP2. Each step's global batch is nproc x "
                     "--micro_batch_size x --grad_accum rows. 0: one process (or as torchrun started it).",
                     lower_bound=0)
flags.DEFINE_string("torchrun_args", "", "With --nproc_per_node: more arguments of torch.distributed.run, e.g. "
                    "'--nnodes=2 --node_rank=0 --rdzv_backend=c10d --rdzv_endpoint=host:29500 --rdzv_id=job1' for "
                    "several machines (default: --standalone, this machine alone).")
flags.DEFINE_integer("expert_parallel", 1, "With several processes: ranks of an expert-parallel group. Each rank "
                     "holds E / N of every MoE layer's routed experts (and their adapters); the routed tokens travel "
                     "to the ranks of their experts and back by all-to-all inside the layer op. Must divide the "
                     "number of processes and the experts; the groups are data-parallel replicas of each other.",
                     lower_bound=1)
flags.DEFINE_float("collective_timeout_s", 600.0, "In a run of several processes: a collective that waits this "
                   "long (a rank died or hangs) ends the job with an error instead of waiting forever.",
                   lower_bound=1.0)

# Non-finite values.
flags.DEFINE_enum("on_nonfinite", "stop", ["stop", "skip"], "When a step's loss or gradient norm is NaN or infinite "
                  "(no update is applied either way): 'stop' the run, naming the step and the first non-finite "
                  "gradient, the last checkpoint kept; or 'skip' the step, counting it, and stop after "
                  "--max_nonfinite_skips such steps in a row.")
flags.DEFINE_integer("max_nonfinite_skips", 10, "With --on_nonfinite=skip: stop after this many non-finite steps in a "
                     "row.", lower_bound=1)

class FlagError(ValueError):
    pass


# Flag name -> the --flagfile that set it (filled from cli.Flagfiles by train.py), so that an error
# about a value the user did not type says where it came from.
SOURCES: dict[str, str] = {}


def shown(name: str, f=FLAGS) -> str:
    """--name=value, and the flagfile it came from."""
    source = f" (from {SOURCES[name]})" if name in SOURCES else ""
    return f"--{name}={f[name].value}{source}"


def validate(f=FLAGS) -> None:
    """Values absl's bounds cannot express, and contradictions between flags (ranges are checked
    by absl as the flags are parsed)."""
    for flag in f.get_flags_for_module(__name__):  # NaN passes every bound check
        if isinstance(flag.value, float) and not math.isfinite(flag.value):
            raise FlagError(f"{shown(flag.name, f)}: expected a finite number")
    for name in ("adam_beta1", "adam_beta2"):
        if f[name].value >= 1:
            raise FlagError(f"{shown(name, f)}: expected a value below 1 (a beta of 1 never updates its moment, "
                            "and AdamW's bias correction divides by zero)")
    if f.adam_eps <= 0:
        raise FlagError(f"{shown('adam_eps', f)}: expected a value > 0 (it keeps AdamW's denominator from zero)")
    if f.lr == 0:
        raise FlagError(f"{shown('lr', f)}: expected a value > 0 (a learning rate of 0 trains nothing)")
    if f.finetune == "lora" and f.lora_alpha == 0:
        raise FlagError(f"{shown('lora_alpha', f)}: expected a value > 0 (the adapters' update is scaled by "
                        "alpha / r: 0 trains adapters that change nothing)")
    if f.lora_dropout >= 1:
        raise FlagError(f"{shown('lora_dropout', f)}: expected a value below 1 (1 drops every LoRA input: nothing "
                        "would train)")
    if bool(f.model_dir) == bool(f.model_config):
        raise FlagError("give exactly one of --model_dir (fine-tune a checkpoint) and --model_config (random weights)")
    if not f.data:
        raise FlagError("--data is required")
    if not f.output_dir:
        raise FlagError("--output_dir is required")
    if f.max_steps == 0 and f.epochs == 0:
        raise FlagError("--max_steps=0 and --epochs=0: nothing to train")
    if f.min_lr > f.lr:
        raise FlagError(f"--min_lr={f.min_lr} is above --lr={f.lr}")
    if f.max_steps and f.warmup_steps > f.max_steps:
        raise FlagError(warmup_too_long(f.max_steps, shown("max_steps", f), f))
    # --finetune=full after a LoRA flagfile (--flagfile=glm5.flags --finetune=full) wins over the
    # flagfile's --lora_* flags; --lora_* flags typed beside --finetune=full contradict it.
    lora_typed = [n for n in ("lora_target_modules", "lora_r", "lora_alpha", "lora_dropout", "lora_experts")
                  if f[n].present and n not in SOURCES]
    if f.finetune == "full" and lora_typed and "finetune" not in SOURCES:
        raise FlagError(f"--lora_* flags contradict --finetune=full (--{lora_typed[0]} given)")
    if f.finetune == "full" and "finetune" in SOURCES and any(f[n].present for n in lora_typed):
        raise FlagError(f"--lora_* flags contradict --finetune=full (from {SOURCES['finetune']})")
    if f.finetune == "lora" and not f.lora_target_modules and not f.lora_experts:
        raise FlagError("--lora_target_modules is empty and --nolora_experts: nothing to adapt")
    if f.torchrun_args and not f.nproc_per_node:
        raise FlagError(f"--torchrun_args={f.torchrun_args!r} needs --nproc_per_node")
    if not f.save_base_model and (f.model_dir or f.finetune == "full"):
        raise FlagError("--nosave_base_model: only a --model_config LoRA run writes a base (base_model/); "
                        + ("a --model_dir checkpoint is its own base" if f.model_dir else
                           "--finetune=full saves every weight in its checkpoints"))
    for step_flag in ("profile_step", "stop_at_step"):
        if f.max_steps and f[step_flag].value > f.max_steps:
            raise FlagError(f"{shown(step_flag, f)} is past the last step (--max_steps={f.max_steps})")
    if f.eval_interval and not f.eval_data:
        raise FlagError("--eval_interval needs --eval_data")


def warmup_too_long(total_steps: int, what: str, f=FLAGS) -> str:
    """Why a warmup longer than the run is refused, and what to do about it."""
    where = " on the command line after the --flagfile" if "warmup_steps" in SOURCES else ""
    return (f"{shown('warmup_steps', f)} is more than the {total_steps} steps of this run ({what}): the learning "
            f"rate would never reach --lr; pass a smaller --warmup_steps{where} (e.g. "
            f"--warmup_steps={total_steps // 10}), or train longer")
