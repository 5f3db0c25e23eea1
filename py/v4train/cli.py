"""What the entry points (//py:train, //py:evaluate) share: paths as users mean them, the
device, and the mean loss over a dataset."""

from __future__ import annotations

import os
import sys

import torch

from v4train.data import Record
from v4train.model import CausalLM, Packed

REPO = os.environ.get("BUILD_WORKSPACE_DIRECTORY") or os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def run_app(name: str, main, argv: list[str]) -> None:
    """absl's app.run(main), with the exit codes docs/reliability.md gives: a flag absl itself
    refuses (a value out of its bounds, an unknown flag) and a usage error main raises (a stray
    argument, a required flag missing) are one line `NAME: message` and exit 2, as every other
    bad input (absl prints its usage and exits 1)."""
    from absl import app, flags

    def parse(args):
        try:
            return flags.FLAGS(args)
        except flags.Error as e:
            print(f"{name}: {e}", file=sys.stderr)
            sys.exit(2)

    def checked(args):
        try:
            return main(args)
        except app.UsageError as e:
            print(f"{name}: {e}", file=sys.stderr)
            return 2

    app.run(checked, argv=argv, flags_parser=parse)


def read_text(path: str, what: str) -> str:
    """The UTF-8 text of a file the user named (`what`, e.g. '--flagfile=x'): a directory, an
    unreadable or a binary file is a ValueError of one line naming it."""
    if os.path.isdir(path):
        raise ValueError(f"{what}: {path} is a directory, expected a text file")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{what}: {path} is not a text file (byte 0x{e.object[e.start]:02x} at byte {e.start} is not "
                         "UTF-8)") from None
    except OSError as e:
        raise ValueError(f"{what}: {path} cannot be read ({e.strerror})") from None


def user_dir() -> str:
    """Where the user ran the command (`bazel run` itself runs in its runfiles folder)."""
    return os.environ.get("BUILD_WORKING_DIRECTORY", os.getcwd())


def output_path(value: str) -> str:
    """A path to write: relative paths resolve from the user's directory."""
    return os.path.join(user_dir(), os.path.expanduser(value))


def input_path(flag: str, value: str, directory: bool = False) -> str:
    """A path to read (a folder if `directory`): from the user's directory, else from the
    repository (the bundled data)."""
    value = os.path.expanduser(value)
    for candidate in (os.path.join(user_dir(), value), os.path.join(REPO, value)):
        if os.path.exists(candidate):
            if directory and not os.path.isdir(candidate):
                raise ValueError(f"--{flag}={value}: {os.path.abspath(candidate)} is a file, expected a directory")
            return os.path.abspath(candidate)
    raise ValueError(f"--{flag}={value}: not found (looked in {user_dir()} and {REPO})")


def pick_device(name: str) -> str:
    """--device: auto picks CUDA when there is one."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device=cuda: this torch build or machine has no CUDA device")
    return name


def mean_loss(model: CausalLM, records: list[Record], token_budget: int, device: str) -> tuple[float, int]:
    """(mean next-token loss over every target token, number of target tokens): each record its
    own document, packed into forward passes of at most token_budget tokens (whole records)."""
    was_training = model.training
    model.eval()  # no LoRA dropout
    total, targets, docs, size = torch.zeros((), dtype=torch.float64), 0, [], 0
    with torch.no_grad():
        for i, r in enumerate(records):
            docs.append(r)
            size += len(r.input_ids)
            if i + 1 == len(records) or size + len(records[i + 1].input_ids) > token_budget:
                batch = Packed.from_documents([d.input_ids for d in docs], [d.labels for d in docs], device)
                total += model.loss(batch).double().cpu()
                targets += batch.num_targets
                docs, size = [], 0
    model.train(was_training)
    return (total / max(targets, 1)).item(), targets
