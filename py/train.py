"""//py:train: fine-tune a GLM-5 or Qwen3.5 model (LoRA or full weights) on JSONL data.

    tools/bazel run //py:train -- --flagfile=glm5.flags

The flags (every one defined, with its help text, in v4train/flags.py; `--help` lists them) are
read once into a RunConfig, and a Trainer built from it runs (v4train/trainer.py, which
reads top to bottom). What a user gets on each kind of fault: docs/reliability.md.
"""

from __future__ import annotations

import os
import signal


def _interrupted_at_start(signum, frame):  # until main() starts: no traceback from inside an import
    os.write(2, b"\ntrain: interrupted before the run started; nothing was written\n")
    os._exit(128 + signum)


signal.signal(signal.SIGINT, _interrupted_at_start)
signal.signal(signal.SIGTERM, _interrupted_at_start)

import json
import shlex
import sys

import torch
from absl import app
from absl import flags as absl_flags

from v4train import cli, distributed, hf_checkpoint, ops
from v4train import flags as trainer_flags
from v4train.flags import FLAGS, SOURCES, FlagError
from v4train.trainer import RunConfig, Trainer, check_expert_parallel, check_random_base

absl_flags.adopt_module_key_flags(trainer_flags)  # --help lists the trainer's flags

LAUNCHER_FLAGS = ("nproc_per_node", "torchrun_args")
SOURCES_ENV = "V4TRAIN_FLAG_SOURCES"


def launch(config: RunConfig, argv: list[str]) -> int:
    """--nproc_per_node=N from a plain command: torch's own launcher (torch.distributed.run, in this
    process) starts N copies of train.py with the same flags (LOCAL_RANK tells each its device), and
    the run's exit status is the first failed rank's (2: its bad input, said in its own line), told
    in one line, not as the launcher's traceback. Refused before any work when there are fewer GPUs
    than processes."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    n = FLAGS.nproc_per_node
    if config.device == "cuda" and n > torch.cuda.device_count():
        raise FlagError(f"--nproc_per_node={n}: this machine has {torch.cuda.device_count()} GPU(s), one process "
                        "each at most")
    distributed.check_divides(config.expert_parallel, n, f"--nproc_per_node={n}")
    config_path = os.path.join(config.model_dir, "config.json") if config.model_dir else config.model_config
    hf_config, model_cfg = hf_checkpoint.read_config(config_path)
    check_expert_parallel(config.expert_parallel, model_cfg, config_path)
    if not config.model_dir:
        check_random_base(config, model_cfg, hf_config)
    own = [a for a in argv[1:] if not any(a.startswith(f"--{name}=") or a == f"--{name}" for name in LAUNCHER_FLAGS)]
    rendezvous = shlex.split(FLAGS.torchrun_args) or ["--standalone"]
    sys.stdout.flush()
    os.environ[SOURCES_ENV] = json.dumps(SOURCES)  # which flags came from a flagfile: the ranks get them expanded
    try:
        run(parse_args([f"--nproc_per_node={n}", *rendezvous, os.path.abspath(__file__), *own,
                        f"--device={config.device}"]))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        how = f"was ended by {failure.signal_name()}" if code < 0 else f"exited with status {code}"
        print(f"train: rank {rank} of {n} {how}; the job is stopped (its own lines above say why)", file=sys.stderr)
        return 128 - code if code < 0 else code
    except SignalException as e:  # the launcher itself was signalled; it has ended the ranks
        return 128 + int(e.sigval)
    return 0


def main(argv):
    # From here a SIGINT is a KeyboardInterrupt again, so the output directory's claim is released.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    code = exit_status()
    if distributed.launched():  # one of torchrun's ranks, its group left (Trainer.run)
        distributed.exit_process(code)
    return code


def exit_status() -> int:
    """The run, as its exit status (docs/reliability.md): bad input is one line and 2."""
    try:
        config = RunConfig.from_flags()
        if FLAGS.nproc_per_node and not distributed.launched():
            return launch(config, ARGV)
        return Trainer(config).run()
    except (FlagError, ValueError, ops.CppOpUnavailable) as e:  # data, config, checkpoint errors are ValueErrors
        print(f"train: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the run claimed its output directory (StopSignal)
        print("\ntrain: interrupted before the run started; nothing was written", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    expanded = cli.expand_flagfiles("train", sys.argv)
    SOURCES.update(json.loads(os.environ.pop(SOURCES_ENV, "{}")) or expanded.sources)  # (a launched rank: its launcher's)
    ARGV = expanded.argv  # flagfiles expanded: what a launched copy is given
    cli.run_app("train", main, ARGV)
