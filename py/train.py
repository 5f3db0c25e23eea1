"""//py:train: fine-tune a GLM-5 or Qwen3.5 model (LoRA or full weights) on JSONL data.

    tools/bazel run //py:train -- --flagfile=glm5.flags

Reads top to bottom: flags -> op table and self-check -> tokenizer -> model (loaded, or random
from a config) -> LoRA -> data -> optimizer -> resume -> the step loop -> final save.
Every flag is defined, with its help text, in v4train/flags.py (`--helpfull` lists them).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch
from absl import app

from v4train import checkpoint, cli, data, hf_checkpoint, lora, ops
from v4train.flags import FLAGS, FlagError, validate
from v4train.metrics import MetricsLog, Progress, peak_memory_mib
from v4train.models import config_from_dict
from v4train.models.causal_lm import CausalLM, Packed
from v4train.ops.check import self_check
from v4train.optim import AdamW, lr_at
from v4train.tokenizer import Tokenizer

FLAGFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flags")


def resolve_flagfiles(argv: list[str]) -> list[str]:
    """--flagfile=NAME: from the user's directory, else from the repository's py/flags/."""
    out = []
    for arg in argv:
        if arg.startswith("--flagfile="):
            name = os.path.expanduser(arg.split("=", 1)[1])
            for candidate in (os.path.join(cli.user_dir(), name), os.path.join(FLAGFILE_DIR, name)):
                if os.path.exists(candidate):
                    arg = "--flagfile=" + os.path.abspath(candidate)
                    break
            else:
                sys.exit(f"train: --flagfile={name}: not found in {cli.user_dir()} or {FLAGFILE_DIR}")
        out.append(arg)
    return out


def input_path(flag: str) -> str:
    return cli.input_path(flag, getattr(FLAGS, flag))


def train_step(model: CausalLM, optimizer: AdamW, micro: list[list[data.Record]], lr: float, max_grad_norm: float,
               device: str) -> tuple[float, float, int]:
    """One optimizer step over the micro-batches (lists of documents): forward and backward of
    each, the loss normalised by the step's target tokens so that accumulation gives the mean,
    then clipping and AdamW. Returns (loss, gradient norm before clipping, tokens).

    Only data movement, backward, scalar reads and op calls happen here: every computation is
    an op (C++ or its reference), which py/tests/test_train_step.py checks.
    """
    normalizer = max(1, sum(d.num_targets for docs in micro for d in docs))
    loss_value, tokens = 0.0, 0
    for docs in micro:
        batch = Packed.from_documents([d.input_ids for d in docs], [d.labels for d in docs], device)
        loss = model.loss(batch, normalizer)
        loss.backward()
        loss_value += loss.item()
        tokens += sum(len(d.input_ids) for d in docs)
    grad_norm = optimizer.ops.v4_clip_grad_norm(optimizer.grads(), max_grad_norm).item()
    optimizer.step(lr)
    optimizer.zero_grad()
    return loss_value, grad_norm, tokens


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        return train()
    except (FlagError, ValueError, ops.CppOpUnavailable) as e:  # data, config, checkpoint errors are ValueErrors
        print(f"train: {e}", file=sys.stderr)
        return 2


def train() -> int:
    validate()
    device, dtype = cli.pick_device(FLAGS.device), getattr(torch, FLAGS.dtype)
    output_dir = cli.output_path(FLAGS.output_dir)
    torch.manual_seed(FLAGS.seed)

    # The ops of this run (--cpp_ops), resolved once; each C++ op checked against its reference
    # on samples of its parity strategy, in this run's dtype and on its device.
    table = ops.resolve(FLAGS.cpp_ops)
    if FLAGS.self_check:
        self_check(table, ops.REFERENCE, dtype, device)

    # The model: a checkpoint, or random weights from a config (saved as the adapter's base).
    if FLAGS.model_dir:
        model_dir = input_path("model_dir")
        model, _ = hf_checkpoint.load(model_dir, dtype, device)
    else:
        config_path = input_path("model_config")
        model_dir = os.path.dirname(config_path)
        with open(config_path) as f:
            hf_config = json.load(f)
        model = CausalLM.random(config_from_dict(hf_config, config_path), hf_config, dtype, device, FLAGS.seed)
    tokenizer_dir = input_path("tokenizer_dir") if FLAGS.tokenizer_dir else model_dir
    tokenizer = Tokenizer(tokenizer_dir) if os.path.exists(os.path.join(tokenizer_dir, "tokenizer.json")) else None
    model.use_ops(table)
    model.checkpointing = FLAGS.gradient_checkpointing

    # What trains: LoRA adapters, or every weight.
    adapters, lcfg = None, None
    if FLAGS.finetune == "lora":
        targets = [t for name in FLAGS.lora_target_modules
                   for t in (model.family.attention_targets if name == "attention" else [name])]
        lcfg = lora.LoraConfig(FLAGS.lora_r, FLAGS.lora_alpha, FLAGS.lora_dropout, tuple(targets), FLAGS.lora_experts)
        adapters = lora.add_adapters(model, lcfg, dtype, device, FLAGS.seed)
        if not FLAGS.model_dir:  # the adapter needs a loadable base
            model_dir = os.path.join(output_dir, "base_model")
            hf_checkpoint.save(model, model_dir)
        trainable = adapters
    else:
        trainable = {n: w for n, w in model.weights().items() if not model.family.is_frozen(n)}
    for w in model.parameters():
        w.requires_grad_(False)
    for w in trainable.values():
        w.requires_grad_(True)

    # Data.
    vocab = model.cfg.vocab_size
    train_set = data.fit_to_length(data.read_records(input_path("data"), tokenizer, vocab), FLAGS.seq_len, FLAGS.overlong)
    eval_records = data.read_records(input_path("eval_data"), tokenizer, vocab) if FLAGS.eval_data else None
    loader = data.Loader(train_set.examples, FLAGS.seq_len, FLAGS.packing, FLAGS.micro_batch_size, FLAGS.seed)
    total_steps = FLAGS.max_steps or max(1, math.ceil(FLAGS.epochs * loader.batches_per_epoch / FLAGS.grad_accum))

    optimizer = AdamW(trainable, table, (FLAGS.adam_beta1, FLAGS.adam_beta2), FLAGS.adam_eps, FLAGS.weight_decay)
    start_step = 0
    if FLAGS.resume_from:
        path = checkpoint.latest(output_dir) if FLAGS.resume_from == "latest" else input_path("resume_from")
        if path is None:
            raise FlagError(f"--resume_from=latest: no checkpoint in {output_dir}")
        state = checkpoint.load(path, model=model, adapters=adapters, optimizer=optimizer)
        loader.load_state(state["loader"])
        start_step = state["step"]
    os.makedirs(output_dir, exist_ok=True)
    metrics = MetricsLog(output_dir, start_step)
    progress = Progress(total_steps, start_step)
    n_trainable = sum(w.numel() for w in trainable.values())
    progress.message(
        f"train: {model.cfg.model_type}, {FLAGS.finetune} ({n_trainable:,} trainable of "
        f"{sum(w.numel() for w in model.parameters()):,} weights), {FLAGS.dtype} on {device}; "
        f"{len(train_set.examples)} examples ({train_set.truncated} truncated, {train_set.dropped} dropped at "
        f"--seq_len={FLAGS.seq_len}), {train_set.num_targets:,} target tokens; {total_steps} steps; "
        f"C++ ops: {', '.join(sorted(table.cpp)) or 'none'}; router bias/aux-loss updates: off")

    def save(step):
        checkpoint.save(output_dir, step, model=model, adapters=adapters, lcfg=lcfg, optimizer=optimizer,
                        state={"loader": loader.state(), "finetune": FLAGS.finetune}, base_model_dir=model_dir,
                        tokenizer_dir=tokenizer_dir if tokenizer else None, keep=FLAGS.save_total_limit)

    # The step loop: Python picks the batch, the ops compute, autograd walks their graph.
    t_start, first_loss, last, eval_loss = time.time(), None, {}, None
    for step in range(start_step + 1, total_steps + 1):
        t0 = time.time()
        lr = lr_at(step, FLAGS.lr, FLAGS.min_lr, FLAGS.warmup_steps, total_steps, FLAGS.lr_schedule)
        micro = [loader.next() for _ in range(FLAGS.grad_accum)]
        loss_value, grad_norm, tokens = train_step(model, optimizer, micro, lr, FLAGS.max_grad_norm, device)
        if device == "cuda":
            torch.cuda.synchronize()
        tokens_per_s = tokens / (time.time() - t0)
        first_loss = loss_value if first_loss is None else first_loss
        last = {"step": step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
                "peak_mem_mib": round(peak_memory_mib(device), 1), "epoch": loader.epoch}
        if eval_records and ((FLAGS.eval_interval and step % FLAGS.eval_interval == 0) or step == total_steps):
            eval_loss = last["eval_loss"] = cli.mean_loss(model, eval_records, FLAGS.seq_len * FLAGS.micro_batch_size,
                                                          device)[0]
        if step % FLAGS.log_interval == 0 or step == total_steps or "eval_loss" in last:
            metrics.write(last)
            progress.update(step, loss_value, lr, tokens_per_s, f" eval {eval_loss:.4f}" if "eval_loss" in last else "")
        stop = step == FLAGS.stop_at_step
        if (FLAGS.save_interval and step % FLAGS.save_interval == 0) or step == total_steps or stop:
            save(step)
        if stop:
            progress.message(f"train: stopped after step {step} (--stop_at_step); resume with --resume_from=latest")
            break

    wall = time.time() - t_start
    if metrics.rows:
        metrics.plot(os.path.join(output_dir, "loss.png"))
    summary = {"steps": total_steps, "first_loss": first_loss, "final_loss": last.get("loss"), "eval_loss": eval_loss,
               "tokens_per_s": round(last.get("tokens_per_s", 0.0), 1), "wall_s": round(wall, 1),
               "output_dir": output_dir, "checkpoint": checkpoint.latest(output_dir)}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    app.run(main, argv=resolve_flagfiles(sys.argv))
