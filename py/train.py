"""//py:train: fine-tune a GLM-5 or Qwen3.5 model (LoRA or full weights) on JSONL data.

    tools/bazel run //py:train -- --flagfile=glm5.flags

Reads top to bottom: flags and paths checked -> config, tokenizer and data read -> the output
directory claimed -> op table and self-check -> model (loaded, or random from a config) -> LoRA
-> optimizer -> resume -> the step loop -> final save. Every flag is defined, with its help text, in
v4train/flags.py (`--helpfull` lists them). What a user gets on each kind of fault:
docs/reliability.md.
"""

from __future__ import annotations

import os
import signal


def _interrupted_at_start(signum, frame):  # until main() starts: no traceback from inside an import
    os.write(2, b"\ntrain: interrupted before the run started; nothing was written\n")
    os._exit(128 + signum)


signal.signal(signal.SIGINT, _interrupted_at_start)
signal.signal(signal.SIGTERM, _interrupted_at_start)

import dataclasses
import json
import math
import sys
import time

import torch
from absl import app

from v4train import checkpoint, cli, data, hf_checkpoint, lora, ops, run_dir
from v4train.flags import FLAGS, SOURCES, FlagError, validate, warmup_too_long
from v4train.metrics import MetricsLog, Progress, peak_memory_mib
from v4train.models.causal_lm import CausalLM, Packed
from v4train.ops.check import self_check
from v4train.optim import AdamW, lr_at
from v4train.tokenizer import Tokenizer

FLAGFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flags")


def _flag_names(lines):
    """The flags that argument or flagfile lines set (--name=value, --name, --noname)."""
    for line in lines:
        line = line.strip()
        if line.startswith("--"):
            name = line[2:].split("=", 1)[0]
            yield name[2:] if name.startswith("no") and name not in FLAGS and name[2:] in FLAGS else name


def resolve_flagfiles(argv: list[str]) -> list[str]:
    """--flagfile=NAME: from the user's directory, else from the repository's py/flags/. Notes
    which flags each flagfile sets (flags.SOURCES) unless a later argument sets them again."""
    out = []
    for arg in argv:
        if arg.startswith("--flagfile="):
            name = os.path.expanduser(arg.split("=", 1)[1])
            for candidate in (os.path.join(cli.user_dir(), name), os.path.join(FLAGFILE_DIR, name)):
                if os.path.exists(candidate):
                    arg = "--flagfile=" + os.path.abspath(candidate)
                    try:
                        text = cli.read_text(candidate, f"--flagfile={name}")
                    except ValueError as e:
                        print(f"train: {e}", file=sys.stderr)
                        sys.exit(2)
                    SOURCES.update({flag: name for flag in _flag_names(text.splitlines())})
                    break
            else:
                print(f"train: --flagfile={name}: not found in {cli.user_dir()} or {FLAGFILE_DIR}", file=sys.stderr)
                sys.exit(2)
        else:
            for flag in _flag_names([arg]):
                SOURCES.pop(flag, None)
        out.append(arg)
    return out


def input_path(flag: str, directory: bool = False) -> str:
    return cli.input_path(flag, getattr(FLAGS, flag), directory)


def say(text: str) -> None:
    print(f"train: {text}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class StepResult:
    loss: float
    grad_norm: float  # before clipping
    tokens: int
    nonfinite: list[str]  # trainable tensors whose gradient holds NaN/inf, when the step is not finite

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


def train_step(model: CausalLM, optimizer: AdamW, micro: list[list[data.Record]], lr: float, max_grad_norm: float,
               device: str) -> StepResult:
    """One optimizer step over the micro-batches (lists of documents): forward and backward of
    each, the loss normalised by the step's target tokens so that accumulation gives the mean,
    then clipping and AdamW. A step whose loss or gradient norm is NaN or inf applies no update
    and names the gradients that hold them.

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
    # The norm first, without clipping: clipping by a NaN norm would turn every gradient to NaN
    # and hide where the non-finite values are.
    grads = optimizer.grads()
    result = StepResult(loss_value, optimizer.ops.v4_clip_grad_norm(grads, 0.0).item(), tokens, [])
    if result.finite:
        if max_grad_norm > 0:
            optimizer.ops.v4_clip_grad_norm(grads, max_grad_norm)
        optimizer.step(lr)
    else:
        result.nonfinite = optimizer.nonfinite_grads()
    optimizer.zero_grad()
    return result


def nonfinite_report(step: int, result: StepResult, micro: list[list[data.Record]]) -> str:
    """What was not finite at `step`, the first gradient that holds it, and the step's data."""
    what = " and ".join(f"the {name} is {value}" for name, value in (("loss", result.loss), ("gradient norm",
                        result.grad_norm)) if not math.isfinite(value))
    grads = (f"; NaN/inf in the gradient of {len(result.nonfinite)} trainable tensor(s), first "
             f"{result.nonfinite[0]}" if result.nonfinite else "")
    where = sorted({d.where for docs in micro for d in docs})
    return f"step {step}: {what}{grads} (data: {', '.join(where[:3])}{', ...' if len(where) > 3 else ''})"


class StopSignal:
    """SIGINT and SIGTERM: the first asks for a checkpoint at the end of the current step and an
    exit (a preemption); a second exits at once (atomic writes keep every checkpoint complete or
    absent). Writes with os.write: a handler may interrupt a print."""

    def __init__(self):
        self.signum = None
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self.handle)

    def handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            os.write(2, f"\ntrain: {name} again: exiting now without saving; the checkpoints written so far are "
                        "complete\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        os.write(2, f"\ntrain: {name}: stopping at the end of this step, with a checkpoint (send {name} again to "
                    "exit at once)\n".encode())


def resume_path(output_dir: str) -> str | None:
    """The checkpoint --resume_from names (latest: the newest complete one in output_dir)."""
    if not FLAGS.resume_from:
        return None
    if FLAGS.resume_from != "latest":
        return input_path("resume_from", directory=True)
    complete, incomplete = checkpoint.scan(output_dir)
    skipped = "; ".join(f"{os.path.basename(p)} is incomplete: {why}" for p, why in sorted(incomplete.items()))
    if not complete:
        raise FlagError(f"--resume_from=latest: no complete checkpoint in {output_dir}"
                        + (f" ({skipped})" if skipped else "") + "; start afresh without --resume_from (and with --overwrite_output_dir if it holds a run)")
    if skipped:
        say(skipped)
    return complete[-1][1]


def main(argv):
    # From here a SIGINT is a KeyboardInterrupt again, so the output directory's claim is released.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        return train()
    except (FlagError, ValueError, ops.CppOpUnavailable) as e:  # data, config, checkpoint errors are ValueErrors
        print(f"train: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the run claimed its output directory (StopSignal)
        print("\ntrain: interrupted before the run started; nothing was written", file=sys.stderr)
        return 128 + signal.SIGINT


def train() -> int:
    # Flags and paths, before any work.
    validate()
    device, dtype = cli.pick_device(FLAGS.device), getattr(torch, FLAGS.dtype)
    table = ops.resolve(FLAGS.cpp_ops)  # the ops of this run (--cpp_ops), resolved once
    model_dir = input_path("model_dir", directory=True) if FLAGS.model_dir else None
    config_path = None if model_dir else input_path("model_config")
    tokenizer_dir = input_path("tokenizer_dir", directory=True) if FLAGS.tokenizer_dir else \
        model_dir or os.path.dirname(config_path)
    data_path = input_path("data")
    eval_path = input_path("eval_data") if FLAGS.eval_data else None
    output_dir = cli.output_path(FLAGS.output_dir)
    resume = resume_path(output_dir)

    # The config, the tokenizer and the data, before any heavy work: a bad file costs no model
    # load. Data is cut to --seq_len, or to the model's max_position_embeddings when that is
    # shorter (positions past it were never trained).
    hf_config, model_cfg = hf_checkpoint.read_config(os.path.join(model_dir, "config.json") if model_dir else config_path)
    tokenizer = Tokenizer(tokenizer_dir) if os.path.exists(os.path.join(tokenizer_dir, "tokenizer.json")) else None
    vocab = model_cfg.vocab_size
    max_positions = hf_config.get("text_config", hf_config).get("max_position_embeddings")
    max_len = min(FLAGS.seq_len, max_positions or FLAGS.seq_len)
    limit = f"--seq_len={FLAGS.seq_len}" if max_len == FLAGS.seq_len else \
        f"the model's max_position_embeddings={max_positions}, below --seq_len={FLAGS.seq_len}"
    train_set = data.fit_to_length(data.read_records(data_path, tokenizer, vocab), max_len, FLAGS.overlong, limit)
    eval_records = data.read_records(eval_path, tokenizer, vocab) if eval_path else None
    too_long = sum(len(r.input_ids) > max_positions for r in eval_records or []) if max_positions else 0
    if too_long:
        say(f"{too_long} of the {len(eval_records)} --eval_data records are longer than the model's "
            f"max_position_embeddings={max_positions}: their loss reads positions it never trained")

    # From here on this run owns output_dir (run_dir.py): no other run writes it meanwhile.
    with run_dir.Claim(output_dir, resume, FLAGS.overwrite_output_dir) as claim:
        for note in claim.notes:
            say(note)
        stop_signal = StopSignal()  # from here SIGINT/SIGTERM stop the run at the end of a step
        torch.manual_seed(FLAGS.seed)
        # Each C++ op checked against its reference on samples of its parity strategy, in this
        # run's dtype and on its device.
        if FLAGS.self_check:
            self_check(table, ops.REFERENCE, dtype, device)

        # The model: a checkpoint, or random weights from a config (saved as the adapter's base).
        if model_dir:
            model, _ = hf_checkpoint.load(model_dir, dtype, device)  # every weight checked finite
        else:
            model = CausalLM.random(model_cfg, hf_config, dtype, device, FLAGS.seed)
            model_dir = os.path.dirname(config_path)
        model.use_ops(table)
        model.checkpointing = FLAGS.gradient_checkpointing

        # What trains: LoRA adapters (every target must match a module), or every weight.
        adapters, lcfg = None, None
        if FLAGS.finetune == "lora":
            targets = lora.expand_targets(model, FLAGS.lora_target_modules)
            lcfg = lora.LoraConfig(FLAGS.lora_r, FLAGS.lora_alpha, FLAGS.lora_dropout, targets, FLAGS.lora_experts)
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

        loader = data.Loader(train_set.examples, FLAGS.seq_len, FLAGS.packing, FLAGS.micro_batch_size, FLAGS.seed)
        total_steps = FLAGS.max_steps or max(1, math.ceil(FLAGS.epochs * loader.batches_per_epoch / FLAGS.grad_accum))
        if FLAGS.warmup_steps > total_steps:
            raise FlagError(warmup_too_long(total_steps, f"--epochs={FLAGS.epochs} of {loader.batches_per_epoch} "
                                                         f"micro-batches, --grad_accum={FLAGS.grad_accum}"))

        optimizer = AdamW(trainable, table, (FLAGS.adam_beta1, FLAGS.adam_beta2), FLAGS.adam_eps, FLAGS.weight_decay)
        start_step = 0
        if resume:
            state = checkpoint.load(resume, model=model, adapters=adapters, lcfg=lcfg, optimizer=optimizer)
            try:
                loader.load_state(state["loader"])
            except ValueError as e:
                raise checkpoint.CheckpointError(f"{resume}/{checkpoint.STATE}: field loader: {e}") from None
            start_step = state["step"]
            if start_step > total_steps:
                raise FlagError(f"--resume_from={resume}: it is step {start_step}, past the {total_steps} steps of this "
                                "run; give a --max_steps of at least that to continue it")
        metrics = MetricsLog(output_dir, start_step)
        if resume and start_step == total_steps:  # nothing left: say so, and end as a finished run does
            progress = Progress(total_steps, start_step)
            progress.message(f"train: the run is finished: {resume} is its last step ({total_steps} of {total_steps}); "
                             "nothing to train. To train further, resume with a larger --max_steps")
            last = next((r for r in reversed(metrics.rows) if "loss" in r), {})
            print(json.dumps({"steps": total_steps, "first_loss": None, "final_loss": last.get("loss"),
                              "eval_loss": last.get("eval_loss"), "nonfinite_skips": 0, "tokens_per_s": 0.0,
                              "wall_s": 0.0, "output_dir": output_dir, "checkpoint": resume, "finished": True}))
            return 0
        progress = Progress(total_steps, start_step)
        n_trainable = sum(w.numel() for w in trainable.values())
        progress.message(
            f"train: {model.cfg.model_type}, {FLAGS.finetune} ({n_trainable:,} trainable of "
            f"{sum(w.numel() for w in model.parameters()):,} weights), {FLAGS.dtype} on {device}; "
            f"{len(train_set.examples)} examples ({train_set.truncated} truncated, {train_set.dropped} dropped at "
            f"{limit}), {train_set.num_targets:,} target tokens; {total_steps} steps; "
            f"C++ ops: {', '.join(sorted(table.cpp)) or 'none'}; router bias/aux-loss updates: off")

        def save(step):
            checkpoint.save(output_dir, step, model=model, adapters=adapters, lcfg=lcfg, optimizer=optimizer,
                            state={"loader": loader.state(), "finetune": FLAGS.finetune}, base_model_dir=model_dir,
                            tokenizer_dir=tokenizer_dir if tokenizer else None, keep=FLAGS.save_total_limit)

        if stop_signal.signum is not None:
            say(f"stopped by {signal.Signals(stop_signal.signum).name} before the first step; nothing new to save")
            return 128 + stop_signal.signum

        # The step loop: Python picks the batch, the ops compute, autograd walks their graph.
        t_start, first_loss, last, eval_loss, skipped, in_a_row = time.time(), None, {}, None, 0, 0
        exit_code = 0
        for step in range(start_step + 1, total_steps + 1):
            t0 = time.time()
            lr = lr_at(step, FLAGS.lr, FLAGS.min_lr, FLAGS.warmup_steps, total_steps, FLAGS.lr_schedule)
            micro = [loader.next() for _ in range(FLAGS.grad_accum)]
            result = train_step(model, optimizer, micro, lr, FLAGS.max_grad_norm, device)
            if not result.finite:  # no update was applied
                skipped, in_a_row = skipped + 1, in_a_row + 1
                report = nonfinite_report(step, result, micro)
                metrics.write({"step": step, "lr": lr, "nonfinite": report})
                if FLAGS.on_nonfinite == "stop" or in_a_row >= FLAGS.max_nonfinite_skips:
                    latest = checkpoint.latest(output_dir)
                    why = "--on_nonfinite=stop" if FLAGS.on_nonfinite == "stop" else \
                        f"{in_a_row} non-finite steps in a row, --max_nonfinite_skips={FLAGS.max_nonfinite_skips}"
                    kept = f"the last checkpoint, {latest}, is kept" if latest else "no checkpoint was written"
                    progress.message(f"train: stopped ({why}) at {report}. No update was applied; {kept}. A lower "
                                     "--lr, or --on_nonfinite=skip for rare bad batches, may help")
                    return 1
                progress.message(f"train: skipped {report} ({in_a_row} in a row; --max_nonfinite_skips="
                                 f"{FLAGS.max_nonfinite_skips})")
            else:
                in_a_row = 0
                if device == "cuda":
                    torch.cuda.synchronize()
                tokens_per_s = result.tokens / (time.time() - t0)
                first_loss = result.loss if first_loss is None else first_loss
                last = {"step": step, "loss": result.loss, "lr": lr, "grad_norm": result.grad_norm,
                        "tokens_per_s": tokens_per_s, "peak_mem_mib": round(peak_memory_mib(device), 1),
                        "epoch": loader.epoch}
                if eval_records and ((FLAGS.eval_interval and step % FLAGS.eval_interval == 0) or step == total_steps):
                    eval_loss = last["eval_loss"] = cli.mean_loss(model, eval_records,
                                                                  FLAGS.seq_len * FLAGS.micro_batch_size, device)[0]
                if step % FLAGS.log_interval == 0 or step == total_steps or "eval_loss" in last:
                    metrics.write(last)
                    progress.update(step, result.loss, lr, tokens_per_s,
                                    f" eval {eval_loss:.4f}" if "eval_loss" in last else "")
            stop = step == FLAGS.stop_at_step or stop_signal.signum is not None
            if (FLAGS.save_interval and step % FLAGS.save_interval == 0) or step == total_steps or stop:
                save(step)
            if stop:
                why = "--stop_at_step" if stop_signal.signum is None else signal.Signals(stop_signal.signum).name
                progress.message(f"train: stopped after step {step} ({why}), saved in {output_dir}/checkpoint-{step}; "
                                 "resume with --resume_from=latest")
                exit_code = 0 if stop_signal.signum is None else 128 + stop_signal.signum
                break

        wall = time.time() - t_start
        if metrics.rows:
            try:
                metrics.plot(os.path.join(output_dir, "loss.png"))
            except OSError as e:  # a full disk: the plot is a convenience, metrics.jsonl holds the numbers
                say(f"could not write {output_dir}/loss.png ({e.strerror or e}); the metrics are in metrics.jsonl")
        summary = {"steps": total_steps, "first_loss": first_loss, "final_loss": last.get("loss"),
                   "eval_loss": eval_loss, "nonfinite_skips": skipped,
                   "tokens_per_s": round(last.get("tokens_per_s", 0.0), 1), "wall_s": round(wall, 1),
                   "output_dir": output_dir, "checkpoint": checkpoint.latest(output_dir)}
        print(json.dumps(summary))
        return exit_code


if __name__ == "__main__":
    cli.run_app("train", main, resolve_flagfiles(sys.argv))
