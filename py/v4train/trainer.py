"""The trainer: a typed run configuration (RunConfig, read once from the flags, or built directly
by a test) and the Trainer it builds: the data, the model, the trainable tensors, the optimizer,
the checkpointer and the logger, then the step loop (torchtitan's shape).

Reads top to bottom: RunConfig.from_flags (flags and paths checked) -> Trainer(config) (the model
config, the tokenizer and the data read, the run's length checked, before any heavy work or any
write) -> Trainer.run(): the output directory claimed -> op self-check -> model (loaded, or random
from a config) -> LoRA -> optimizer -> resume -> the step loop -> final save. What a user gets on
each kind of fault: docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import time

import torch

from v4train import checkpoint, cli, data, distributed, hf_checkpoint, lora, ops, random_init, run_dir
from v4train.atomic import kill_point
from v4train.distributed import World
from v4train.flags import FLAGS, FlagError, validate, warmup_too_long
from v4train.metrics import MetricsLog, Progress, peak_memory_mib
from v4train.model import CausalLM, Packed
from v4train.models import ops_of
from v4train.testing.check import self_check
from v4train.optim import AdamW, lr_at
from v4train.step_profile import Profiled
from v4train.tokenizer import Tokenizer


def say(text: str) -> None:
    print(f"train: {text}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything a run is told, typed; paths absolute. `from_flags` reads absl's flags once
    (the command-line interface); tests build one directly."""

    data: str
    output_dir: str
    model_dir: str | None = None  # a checkpoint to fine-tune, or
    model_config: str | None = None  # a config.json to start from random weights (drawn on the device)
    save_base_model: bool = True  # a --model_config LoRA run writes its random base to output_dir/base_model
    tokenizer_dir: str | None = None  # default: the model's folder
    eval_data: str | None = None
    resume_from: str | None = None  # a checkpoint folder (already resolved from 'latest')
    eval_interval: int = 0
    seq_len: int = 1024
    overlong: str = "truncate"
    packing: bool = True
    dtype: torch.dtype = torch.bfloat16
    device: str = "cpu"
    cpp_ops: str = "all"
    self_check: bool = True
    gradient_checkpointing: bool = False
    profile_step: int = 0  # the step rank 0 profiles (0: none)
    micro_batch_size: int = 4
    grad_accum: int = 1
    max_steps: int = 0
    epochs: float = 1.0
    lr: float = 2e-4
    min_lr: float = 0.0
    warmup_steps: int = 0
    lr_schedule: str = "cosine"
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0
    seed: int = 0
    finetune: str = "lora"
    fp8: str = "keep"  # an FP8 checkpoint kept in FP8 (LoRA on a frozen base) or dequantised on load
    lora_r: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lora_target_modules: tuple[str, ...] = ("attention",)
    lora_experts: bool = True
    save_interval: int = 0
    save_total_limit: int = 2
    log_interval: int = 1
    stop_at_step: int = 0
    overwrite_output_dir: bool = False
    on_nonfinite: str = "stop"
    max_nonfinite_skips: int = 10
    collective_timeout_s: float = 600.0  # a collective that waits longer ends the job (a rank died or hung)
    expert_parallel: int = 1  # ranks of an expert-parallel group (each holds E / N routed experts)

    @staticmethod
    def from_flags(f=FLAGS) -> "RunConfig":
        """The flags, validated (FlagError / ValueError naming the flag), paths resolved as the
        user means them (relative to where they ran the command, else the repository's)."""
        validate(f)
        path = lambda flag, directory=False: cli.input_path(flag, f[flag].value, directory)  # noqa: E731
        model_dir = path("model_dir", True) if f.model_dir else None
        config_path = None if model_dir else path("model_config")
        output_dir = cli.output_path(f.output_dir)
        data, eval_data = path("data"), path("eval_data") if f.eval_data else None
        processes = f.nproc_per_node or distributed.launched_size()
        for flag, value in (("data", data), ("eval_data", eval_data)):
            if value and processes > 1 and not os.path.isfile(value):  # (a FIFO: the second rank's open would wait)
                raise FlagError(f"--{flag}={f[flag].value} is not a file (a pipe?): one process reads it once, and "
                                f"each of the {processes} processes reads --{flag}; give a file")
        return RunConfig(
            data=data, output_dir=output_dir, model_dir=model_dir, model_config=config_path,
            save_base_model=f.save_base_model,
            tokenizer_dir=path("tokenizer_dir", True) if f.tokenizer_dir else None,
            eval_data=eval_data,
            resume_from=resume_path(f.resume_from, output_dir), eval_interval=f.eval_interval, seq_len=f.seq_len,
            overlong=f.overlong, packing=f.packing, dtype=getattr(torch, f.dtype), device=cli.pick_device(f.device),
            cpp_ops=f.cpp_ops, self_check=f.self_check, gradient_checkpointing=f.gradient_checkpointing,
            profile_step=f.profile_step,
            micro_batch_size=f.micro_batch_size, grad_accum=f.grad_accum, max_steps=f.max_steps, epochs=f.epochs,
            lr=f.lr, min_lr=f.min_lr, warmup_steps=f.warmup_steps, lr_schedule=f.lr_schedule,
            weight_decay=f.weight_decay, betas=(f.adam_beta1, f.adam_beta2), adam_eps=f.adam_eps,
            max_grad_norm=f.max_grad_norm, seed=f.seed, finetune=f.finetune, fp8=f.fp8, lora_r=f.lora_r,
            lora_alpha=f.lora_alpha, lora_dropout=f.lora_dropout, lora_target_modules=tuple(f.lora_target_modules),
            lora_experts=f.lora_experts,
            save_interval=f.save_interval, save_total_limit=f.save_total_limit, log_interval=f.log_interval,
            stop_at_step=f.stop_at_step, overwrite_output_dir=f.overwrite_output_dir, on_nonfinite=f.on_nonfinite,
            max_nonfinite_skips=f.max_nonfinite_skips, collective_timeout_s=f.collective_timeout_s,
            expert_parallel=f.expert_parallel)


def check_expert_parallel(n: int, model_cfg, config_path: str) -> None:
    """--expert_parallel=n shares each MoE layer's routed experts equally (FlagError otherwise)."""
    experts = distributed.routed_experts(model_cfg)
    if n > 1 and (not experts or experts % n):
        raise FlagError(f"--expert_parallel={n}: {config_path} has {experts} routed experts, which that many ranks "
                        "cannot share equally")


def check_random_base(c: RunConfig, model_cfg, hf_config: dict) -> None:
    """What a --model_config run cannot do with its random base (FlagError): fine-tune every weight
    of an FP8 one (a frozen base), or write an FP8 one as base_model/ (the writer has no scales)."""
    if not random_init.fp8_weights(model_cfg, hf_config, c.fp8, c.model_config):
        return
    what = (f"--model_config={c.model_config} has an FP8 quantization_config, so its random base is drawn in FP8 "
            "(--fp8=keep, the default)")
    if c.finetune == "full":
        raise FlagError(f"--finetune=full: {what}, a frozen base that only LoRA adapters train on; full fine-tuning "
                        "trains every weight: pass --fp8=dequantize to draw it in --dtype")
    if c.save_base_model:
        raise FlagError(f"--save_base_model: {what}, which cannot be written as base_model/ (v4train writes weights "
                        "unquantised); pass --nosave_base_model (a resume draws the same base again from --seed), or "
                        "--fp8=dequantize to draw it in --dtype")


def resume_path(resume_from: str | None, output_dir: str) -> str | None:
    """The checkpoint --resume_from names (latest: the newest complete one in output_dir)."""
    if not resume_from:
        return None
    if resume_from != "latest":
        return cli.input_path("resume_from", resume_from, directory=True)
    complete, incomplete = checkpoint.scan(output_dir)
    skipped = "; ".join(f"{os.path.basename(p)} is incomplete: {why}" for p, why in sorted(incomplete.items()))
    if not complete and (pid := run_dir.writer(output_dir)):
        raise FlagError(f"--resume_from=latest: {output_dir} has no checkpoint yet, and another run (pid {pid}) is "
                        "writing it; wait for that run's first checkpoint (--save_interval) or its end, or choose "
                        "another --output_dir")
    if not complete:
        raise FlagError(f"--resume_from=latest: no complete checkpoint in {output_dir}"
                        + (f" ({skipped})" if skipped else "")
                        + "; start afresh without --resume_from (and with --overwrite_output_dir if it holds a run)")
    if skipped:
        say(skipped)
    return complete[-1][1]


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
               device: str, world: World = World()) -> StepResult:
    """One optimizer step over the micro-batches (lists of documents) of the global batch:
    forward and backward of each, the loss normalised by the step's target tokens so that
    accumulation gives the mean, then clipping and AdamW. A step whose loss or gradient norm is
    NaN or inf applies no update and names the gradients that hold them.

    With many ranks, `micro` is the whole global batch (world.size x --grad_accum micro-batches, in
    data order; every rank reads the same stream) and this rank runs its own consecutive share:
    its losses are over the global target count / world.size, so the gradients FSDP2 averages over
    the ranks are the global batch's, and the same rows give the same step whatever the world
    size. The gradient norm is over every rank's shards; the loss logged is the global mean.

    Only data movement, backward, scalar reads and op calls happen here: every computation is
    an op (C++ or its reference), which py/tests/test_train_step.py checks.
    """
    kill_point("step")  # (the tests' fault injection)
    normalizer = max(1, sum(d.num_targets for docs in micro for d in docs)) / world.size  # FSDP2 averages
    share = len(micro) // world.size
    loss_value, tokens = 0.0, 0
    for docs in micro[world.rank * share:(world.rank + 1) * share]:
        batch = Packed.from_documents([d.input_ids for d in docs], [d.labels for d in docs], device)
        loss = model.loss(batch, normalizer)
        loss.backward()
        loss_value += loss.item()
        tokens += sum(len(d.input_ids) for d in docs)
    # The norm first, without clipping: clipping by a NaN norm would turn every gradient to NaN
    # and hide where the non-finite values are.
    distributed.sync_experts(optimizer.params, world)
    grads = optimizer.grads()
    copies = optimizer.grad_copies() if world.expert_parallel > 1 else None  # the experts' replicas count once
    norm = optimizer.ops.v4_clip_grad_norm(grads, 0.0, world.group, copies).item()
    loss_value, tokens = world.sum([loss_value, tokens], device)
    result = StepResult(loss_value / world.size, norm, int(tokens), [])
    if result.finite:
        if max_grad_norm > 0:
            optimizer.ops.v4_clip_grad_norm(grads, max_grad_norm, world.group, copies)
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
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def restore(self) -> None:
        """The handlers as they were (a Trainer run from a test or a notebook leaves none behind)."""
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            os.write(2, f"\ntrain: {name} again: exiting now without saving; the checkpoints written so far are "
                        "complete\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        os.write(2, f"\ntrain: {name}: stopping at the end of this step, with a checkpoint (send {name} again to "
                    "exit at once)\n".encode())


class Trainer:
    """One run of `config`. Construction reads the model's config, the tokenizer and the data
    (a bad file costs no model load); run() does the rest and returns the exit status, printing
    the final JSON line. The parts a distributed run will make rank-aware are its attributes:
    the model, the loader, the optimizer, the checkpointer (`save`) and the logger."""

    def __init__(self, config: RunConfig):
        c = self.config = config
        self.table = ops.resolve(c.cpp_ops)  # the ops of this run, resolved once
        self.config_path = os.path.join(c.model_dir, "config.json") if c.model_dir else c.model_config
        self.tokenizer_dir = c.tokenizer_dir or c.model_dir or os.path.dirname(c.model_config)
        self.hf_config, self.model_cfg = hf_checkpoint.read_config(self.config_path)
        check_expert_parallel(c.expert_parallel, self.model_cfg, self.config_path)
        if not c.model_dir:
            check_random_base(c, self.model_cfg, self.hf_config)
        tok_file = os.path.join(self.tokenizer_dir, "tokenizer.json")
        self.tokenizer = Tokenizer(self.tokenizer_dir) if os.path.exists(tok_file) else None
        # Data cut to --seq_len, or to the model's max_position_embeddings when that is shorter
        # (positions past it were never trained).
        vocab = self.model_cfg.vocab_size
        max_positions = self.hf_config.get("text_config", self.hf_config).get("max_position_embeddings")
        max_len = min(c.seq_len, max_positions or c.seq_len)
        self.limit = f"--seq_len={c.seq_len}" if max_len == c.seq_len else \
            f"the model's max_position_embeddings={max_positions}, below --seq_len={c.seq_len}"
        self.notes = []  # what the run says at its start (rank 0), of the data here
        self.train_set = data.fit_to_length(data.read_records(c.data, self.tokenizer, vocab, self.notes), max_len,
                                            c.overlong, self.limit)
        self.eval_records = data.read_records(c.eval_data, self.tokenizer, vocab, self.notes) if c.eval_data else None
        if self.eval_records is not None and not sum(r.num_targets for r in self.eval_records):
            raise data.DataError(f"--eval_data={c.eval_data}: no target tokens (every label is -100 or every record "
                                 "has one token), so no eval loss: give records with assistant or completion tokens")
        too_long = sum(len(r.input_ids) > max_positions for r in self.eval_records or []) if max_positions else 0
        if too_long:
            say(f"{too_long} of the {len(self.eval_records)} --eval_data records are longer than the model's "
                f"max_position_embeddings={max_positions}: their loss reads positions it never trained")
        # The loader and the run's length, here: a warmup longer than the run is refused before
        # anything is written (a --model_config LoRA run writes base_model/ before its first step).
        self.loader = data.Loader(self.train_set.examples, c.seq_len, c.packing, c.micro_batch_size, c.seed)
        batches = self.loader.batches_per_epoch
        self.total_steps = c.max_steps or max(1, math.ceil(c.epochs * batches / c.grad_accum))
        if c.warmup_steps > self.total_steps:
            raise FlagError(warmup_too_long(self.total_steps, f"--epochs={c.epochs} of {batches} micro-batches, "
                                                              f"--grad_accum={c.grad_accum}"))
        for name, step in (("profile_step", c.profile_step), ("stop_at_step", c.stop_at_step)):
            if step > self.total_steps:
                raise FlagError(f"--{name}={step} is past the last of the run's {self.total_steps} steps")

    # -- the parts, built in run() in this order ------------------------------------------------

    def build_model(self) -> None:
        """The model (a checkpoint, or random weights from a config, saved as the adapter's base
        for LoRA unless --nosave_base_model) and what trains: LoRA adapters (every target must
        match a module) or every weight. Each rank reads, or draws, only its experts and its FSDP2
        shards' rows."""
        c = self.config
        experts = distributed.local_experts(self.model_cfg, self.world)
        self.base_model_dir = c.model_dir or os.path.dirname(c.model_config)
        if c.model_dir:
            # every weight checked finite; with expert parallelism only this rank's experts read
            self.model, report = hf_checkpoint.load(c.model_dir, c.dtype, c.device, c.fp8, experts, self.world.shard)
            if c.finetune == "full" and self.model.fp8:
                raise FlagError(f"--finetune=full: {c.model_dir} is an FP8 checkpoint, kept in FP8 (--fp8=keep, the "
                                "default), a frozen base that only LoRA adapters train on; full fine-tuning trains "
                                "every weight: pass --fp8=dequantize")
        else:
            self.model, report = random_init.draw(self.model_cfg, self.hf_config, c.dtype, c.device, c.fp8, c.seed,
                                                  experts, self.world.shard, c.model_config)
        rows = report.get("rows", {})  # this rank's rows of the tensors FSDP2 shards (several processes)
        model = self.model
        model.use_ops(self.table)
        model.checkpointing = c.gradient_checkpointing
        self.adapters, self.lcfg = None, None
        if c.finetune == "lora":
            targets = lora.expand_targets(model, list(c.lora_target_modules))
            moe = lora.has_experts(model)  # (--lora_experts, the default, on a model without any: none to adapt)
            self.lcfg = lora.LoraConfig(c.lora_r, c.lora_alpha, c.lora_dropout, targets, c.lora_experts and moe)
            mlp = [t for t in targets if t.rsplit(".", 1)[-1] in ("gate_proj", "up_proj", "down_proj")]
            if mlp and moe and self.world.main:
                say(f"--lora_target_modules: {', '.join(mlp)} of an MoE model train and reload in v4train, but peft "
                    "0.21 does not load such adapters (it reads those names as the fused experts'; README, Known "
                    "limits)")
            self.adapters = lora.add_adapters(model, self.lcfg, c.dtype, c.device, c.seed)
            self.trainable = self.adapters
        else:
            self.trainable = {n: w for n, w in model.weights().items() if not model.family.is_frozen(n)}
        for w in model.parameters():
            w.requires_grad_(False)
        for w in self.trainable.values():
            w.requires_grad_(True)
        if self.world.size > 1:
            # Each rank keeps its experts, FSDP2 shards the rest (the checkpoint's on the meta device
            # until their rows fill the shards): every parameter is replaced by its shard (a
            # DTensor), so what trains is looked up again.
            distributed.shard_experts(model, self.world)
            distributed.shard(model, self.world)
            distributed.fill_shards(model, rows)
            self.trainable = {n: model.get_parameter(n) for n in self.trainable}
            if self.adapters is not None:
                self.adapters = {n: self.trainable[n] for n in self.adapters}
        if self.adapters is not None and not c.model_dir and c.save_base_model:  # the adapters' loadable base
            self.base_model_dir = os.path.join(c.output_dir, "base_model")
            self.write_base()
        elif self.adapters is not None and not c.model_dir and self.world.main and \
                any(n.endswith(".safetensors") for n in os.listdir(self.base_model_dir)):
            say(f"--nosave_base_model: the adapters name {self.base_model_dir} (the config's folder) as their base, "
                "and it holds weights other than the random base they train on: peft would load them onto those; "
                "give the config a folder of its own")

    def write_base(self) -> None:
        """The random base into base_model_dir, written by rank 0: over several processes each
        weight gathered whole as rank 0 writes it (every rank takes part in each gather, in model
        order), one at a time."""
        weights = distributed.gathered(self.model.weights()) if self.world.size > 1 else None
        if self.world.main:
            hf_checkpoint.save(self.model, self.base_model_dir, weights=weights)
        elif weights is not None:
            distributed.take_part(weights)
        self.world.barrier()

    def build_optimizer(self) -> None:
        """AdamW; it and the loader's position restored from the checkpoint resumed."""
        c = self.config
        self.optimizer = AdamW(self.trainable, self.table, c.betas, c.adam_eps, c.weight_decay)
        self.start_step = 0
        if c.resume_from:
            saved_world = hf_checkpoint.read_json(os.path.join(c.resume_from, checkpoint.STATE)).get("world_size", 1)
            if saved_world != self.world.size:
                raise checkpoint.CheckpointError(
                    f"--resume_from={c.resume_from}: it was written by {saved_world} process(es), this run has "
                    f"{self.world.size}: resume with --nproc_per_node={saved_world} (the global batch and the data "
                    "order depend on it); its adapter loads into any number")
            state = checkpoint.load(c.resume_from, model=self.model, adapters=self.adapters, lcfg=self.lcfg,
                                    optimizer=self.optimizer, world=self.world)
            try:  # each step takes world size x grad_accum micro-batches
                self.loader.load_state(state["loader"], state["step"] * c.grad_accum * self.world.size)
            except ValueError as e:
                raise checkpoint.CheckpointError(f"{c.resume_from}/{checkpoint.STATE}: field loader: {e}") from None
            self.start_step = state["step"]
            if self.start_step > self.total_steps:
                raise FlagError(f"--resume_from={c.resume_from}: it is step {self.start_step}, past the "
                                f"{self.total_steps} steps of this run; give a --max_steps of at least that to "
                                "continue it")
            if 0 < c.stop_at_step <= self.start_step < self.total_steps:
                raise FlagError(f"--stop_at_step={c.stop_at_step}: --resume_from={c.resume_from} is already at step "
                                f"{self.start_step}; give a later step, or leave the flag out to train to the end")
            if self.world.main:
                say(f"resuming {c.resume_from}: step {self.start_step} of {self.total_steps} done")

    def save(self, step: int) -> None:
        """The checkpointer: checkpoint-STEP of the adapters or weights, optimizer, RNG and data
        position. Every rank gathers the sharded tensors whole; rank 0 writes them: the adapters
        gathered at once (they are small), a full fine-tuning's weights one at a time as rank 0
        writes each (the other ranks take part in each gather, in the same order)."""
        c, world = self.config, self.world
        adapters = None if self.adapters is None else dict(distributed.gathered(self.adapters))
        weights = distributed.gathered(self.model.weights()) if self.adapters is None and world.size > 1 else None
        rng = world.gather(checkpoint.rng_states())
        # One process: the optimizer state in a file; several: each rank writes its shards.
        whole = self.optimizer.state_tensors() if world.size == 1 else None
        shards = None if world.size == 1 else self.optimizer.sharded_state()
        if world.main:
            checkpoint.save(c.output_dir, step, model=self.model, adapters=adapters, lcfg=self.lcfg,
                            optimizer_state=whole, optimizer_steps=self.optimizer.step_count,
                            state={"loader": self.loader.state(), "finetune": c.finetune, "world_size": world.size},
                            base_model_dir=self.base_model_dir,
                            tokenizer_dir=self.tokenizer_dir if self.tokenizer else None, keep=c.save_total_limit,
                            rng=rng, write_sharded=None if shards is None else
                            lambda folder: distributed.save_sharded(shards, world, folder), weights=weights)
        else:
            if weights is not None:
                distributed.take_part(weights)
            if shards is not None:
                try:
                    distributed.save_sharded(shards, world, None)
                except OSError as e:  # every rank's error, which rank 0 reports as its CheckpointError
                    raise checkpoint.CheckpointError(f"writing checkpoint-{step} failed ({e})") from None
        world.barrier()

    # -- the run --------------------------------------------------------------------------------

    def run(self) -> int:
        c = self.config
        self.world = distributed.join(c.device, c.collective_timeout_s, c.expert_parallel)  # or torchrun's world
        try:
            # From here on this run owns output_dir (run_dir.py): no other run writes it meanwhile.
            # Rank 0 claims it for the job; the others wait for it.
            claim = run_dir.Claim(c.output_dir, c.resume_from, c.overwrite_output_dir) if self.world.main else \
                contextlib.nullcontext()
            with claim:
                for note in getattr(claim, "notes", []) + self.notes + [cli.slow_dtype_note(c.device, c.dtype)]:
                    if note and self.world.main:
                        say(note)
                self.world.barrier()
                self.stop_signal = StopSignal()  # from here SIGINT/SIGTERM stop the run at the end of a step
                try:
                    return self._run()
                finally:
                    self.stop_signal.restore()
        finally:
            distributed.leave()

    def _run(self) -> int:
        c, world = self.config, self.world
        torch.manual_seed(c.seed + world.rank)  # each rank its own dropout masks
        # Each C++ op checked against its reference on samples of its parity strategy, in this
        # run's dtype and on its device.
        if c.self_check:
            self_check(self.table, ops.REFERENCE, c.dtype, c.device)
        self.build_model()
        self.build_optimizer()
        self.metrics = MetricsLog(c.output_dir, self.start_step, writes=world.main)
        self.progress = Progress(self.total_steps, self.start_step,
                                 sys.stderr if world.main else open(os.devnull, "w"))  # noqa: SIM115
        if c.resume_from and self.start_step == self.total_steps:
            return self._finished()
        self._announce()
        if self.stop_signal.signum is not None:
            say(f"stopped by {signal.Signals(self.stop_signal.signum).name} before the first step; nothing new to save")
            return 128 + self.stop_signal.signum
        return self._loop()

    def _announce(self) -> None:
        c, model, ts = self.config, self.model, self.train_set
        n_trainable = sum(w.numel() for w in self.trainable.values())
        self.progress.message(
            f"train: {model.cfg.model_type}, {c.finetune} ({n_trainable:,} trainable of "
            f"{sum(w.numel() for w in model.parameters()):,} weights), {str(c.dtype).removeprefix('torch.')} on "
            f"{c.device}; {len(ts.examples)} examples ({ts.truncated} truncated, {ts.dropped} dropped at "
            f"{self.limit}), {ts.num_targets:,} target tokens; {self.total_steps} steps; "
            f"C++ ops: {', '.join(ops_of(model.cfg, self.table.cpp)) or 'none'}; router bias/aux-loss updates: off")

    def _finished(self) -> int:
        """A resumed run that was already at its last step: say so, and end as a finished run does."""
        c = self.config
        self.progress.message(f"train: the run is finished: {c.resume_from} is its last step ({self.total_steps} of "
                              f"{self.total_steps}); nothing to train. To train further, resume with a larger "
                              "--max_steps")
        if not self.world.main:
            return 0
        last = next((r for r in reversed(self.metrics.rows) if "loss" in r), {})
        print(json.dumps({"steps": self.total_steps, "first_loss": None, "final_loss": last.get("loss"),
                          "eval_loss": last.get("eval_loss"), "nonfinite_skips": 0, "tokens_per_s": 0.0,
                          "wall_s": 0.0, "output_dir": c.output_dir, "checkpoint": c.resume_from, "finished": True}))
        return 0

    def _loop(self) -> int:
        """The step loop: Python picks the batch, the ops compute, autograd walks their graph."""
        c, progress, metrics, loader = self.config, self.progress, self.metrics, self.loader
        t_start, first_loss, last, eval_loss, skipped, in_a_row = time.time(), None, {}, None, 0, 0
        unlogged, final_loss = [], None  # the losses of the steps since the last row: a row's loss is their mean
        exit_code, done, first_step, eval_step = 0, self.start_step, None, None
        for step in range(self.start_step + 1, self.total_steps + 1):
            t0 = time.time()
            lr = lr_at(step, c.lr, c.min_lr, c.warmup_steps, self.total_steps, c.lr_schedule)
            micro = [loader.next() for _ in range(c.grad_accum * self.world.size)]
            profiled = Profiled(c.device, os.path.join(c.output_dir, f"profile-step{step}.json")) \
                if step == c.profile_step and self.world.main else contextlib.nullcontext()
            with profiled:
                result = train_step(self.model, self.optimizer, micro, lr, c.max_grad_norm, c.device, self.world)
            done = step
            if not result.finite:  # no update was applied
                skipped, in_a_row = skipped + 1, in_a_row + 1
                report = nonfinite_report(step, result, micro)
                metrics.write({"step": step, "lr": lr, "nonfinite": report})
                if c.on_nonfinite == "stop" or in_a_row >= c.max_nonfinite_skips:
                    latest = checkpoint.latest(c.output_dir)
                    why = "--on_nonfinite=stop" if c.on_nonfinite == "stop" else \
                        f"{in_a_row} non-finite steps in a row, --max_nonfinite_skips={c.max_nonfinite_skips}"
                    kept = f"the last checkpoint, {latest}, is kept" if latest else "no checkpoint was written"
                    progress.message(f"train: stopped ({why}) at {report}. No update was applied; {kept}. A lower "
                                     "--lr, or --on_nonfinite=skip for rare bad batches, may help")
                    return 1
                progress.message(f"train: skipped {report} ({in_a_row} in a row; --max_nonfinite_skips="
                                 f"{c.max_nonfinite_skips})")
            else:
                in_a_row = 0
                if c.device == "cuda":
                    torch.cuda.synchronize()
                tokens_per_s = result.tokens / (time.time() - t0)
                if first_loss is None:
                    first_loss, first_step = result.loss, step
                unlogged.append(result.loss)
                final_loss = result.loss
                last = {"step": step, "loss": sum(unlogged) / len(unlogged), "lr": lr, "grad_norm": result.grad_norm,
                        "tokens_per_s": tokens_per_s, "peak_mem_mib": round(peak_memory_mib(c.device), 1),
                        "epoch": loader.epoch}
                if getattr(profiled, "split", None):
                    last["profile"] = profiled.split
                if self.eval_records and ((c.eval_interval and step % c.eval_interval == 0) or step == self.total_steps):
                    eval_loss = last["eval_loss"] = cli.mean_loss(self.model, self.eval_records,
                                                                  c.seq_len * c.micro_batch_size, c.device)[0]
                    eval_step = step
                if step % c.log_interval == 0 or step == self.total_steps or {"eval_loss", "profile"} & set(last):
                    metrics.write(last)
                    unlogged = []
                    progress.update(step, last["loss"], lr, tokens_per_s,
                                    f" eval {eval_loss:.4f}" if "eval_loss" in last else "")
            signum = self.stop_signal.signum
            if self.world.size > 1 and self.world.sum([float(signum is not None)], c.device)[0] and signum is None:
                signum = signal.SIGTERM  # another rank was signalled: every rank stops after the same step
            stop = step == c.stop_at_step or signum is not None
            if (c.save_interval and step % c.save_interval == 0) or step == self.total_steps or stop:
                self.save(step)
            if stop:
                why = "--stop_at_step" if signum is None else signal.Signals(signum).name
                progress.message(f"train: stopped after step {step} ({why}), saved in {c.output_dir}/checkpoint-{step}; "
                                 "resume with --resume_from=latest")
                exit_code = 0 if signum is None else 128 + signum
                break

        wall = time.time() - t_start
        if not self.world.main:
            return exit_code
        if metrics.rows:
            try:
                metrics.plot(os.path.join(c.output_dir, "loss.png"))
            except OSError as e:  # a full disk: the plot is a convenience, metrics.jsonl holds the numbers
                say(f"could not write {c.output_dir}/loss.png ({e.strerror or e}); the metrics are in metrics.jsonl")
        # steps: the last step done (a stop before the end says so); first_loss and eval_loss name their steps
        # (a resumed run's first is its first step after the checkpoint).
        print(json.dumps({"steps": done, "first_step": first_step, "first_loss": first_loss,
                          "final_loss": final_loss, "eval_step": eval_step, "eval_loss": eval_loss,
                          "nonfinite_skips": skipped,
                          "tokens_per_s": round(last.get("tokens_per_s", 0.0), 1), "wall_s": round(wall, 1),
                          "output_dir": c.output_dir, "checkpoint": checkpoint.latest(c.output_dir)}))
        return exit_code
