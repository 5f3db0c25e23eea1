"""What the entry points (//py:train, //py:evaluate) share: paths as users mean them, the
device, and the mean loss over a dataset."""

from __future__ import annotations

import os
import re
import sys

import torch

from v4train.data import Record
from v4train.model import CausalLM, Packed

REPO = os.environ.get("BUILD_WORKSPACE_DIRECTORY") or os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


HELP_FLAGS = ("--help", "-help", "-?", "--helpshort", "--helpfull", "--helpxml")


def run_app(name: str, main, argv: list[str]) -> None:
    """absl's app.run(main), with the exit codes docs/reliability.md gives: a flag absl itself
    refuses (a value out of its bounds, an unknown flag) and a usage error main raises (a stray
    argument, a required flag missing) are one line `NAME: message` and exit 2, as every other
    bad input (absl prints its usage and exits 1). --help (or -h) exits 0."""
    from absl import app, flags

    def parse(args):
        try:
            return flags.FLAGS(args)
        except flags.Error as e:
            print(f"{name}: {e}", file=sys.stderr)
            sys.exit(2)
        except SystemExit as e:  # --help and its kin: absl prints the help and exits 1; asked for, it is no failure
            sys.exit(0 if e.code == 1 and any(a.split("=", 1)[0] in HELP_FLAGS for a in args[1:]) else e.code)

    def checked(args):
        try:
            return main(args)
        except app.UsageError as e:
            print(f"{name}: {e}", file=sys.stderr)
            return 2

    argv = expand_flagfiles(name, [a if a != "-h" else "--help" for a in argv]).argv  # (-h: absl has -?)
    app.run(checked, argv=argv, flags_parser=parse)


FLAGFILE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "flags")  # py/flags


def expand_flagfiles(name: str, argv: list[str]) -> "Flagfiles":
    """argv's flagfiles expanded (Flagfiles); a bad one is `NAME: message` and exit 2."""
    from absl import flags

    try:
        return Flagfiles(argv, FLAGFILE_DIR, lambda flag: flag in flags.FLAGS)
    except ValueError as e:
        print(f"{name}: {e}", file=sys.stderr)
        sys.exit(2)


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


class Flagfiles:
    """The command line with each --flagfile=NAME (or `--flagfile NAME`) replaced by its lines, so
    that absl parses one flat list and every flag's origin is known (`sources`: flag -> the
    flagfile that set it last, absent when a typed argument set it after).

    NAME is looked up in the user's directory, then in `search` (the repository's py/flags/); one
    named inside a flagfile, in that flagfile's directory first, so a flagfile can start from
    another (`--flagfile=glm5.flags` then its own overrides). In a flagfile, blank lines and lines
    starting with # or // are comments, and so is the rest of a line after whitespace and #
    (absl would read it into the value: `--output_dir=runs/x  # mine` a folder named so); a value
    that holds one writes it \\#. Within one level (the command line or one flagfile), a flag set on
    its own line before a --flagfile that sets it again is refused: the later value would win,
    silently (one flagfile after another overrides it, as a typed flag after a flagfile does).
    Errors are ValueErrors of one line naming the flagfile (and its line)."""

    def __init__(self, argv: list[str], search: str, names_flag=lambda name: True):
        self.search, self.names_flag, self.sources = search, names_flag, {}
        self.argv = [argv[0], *(arg for arg, _ in self._expand([(a, None) for a in argv[1:]], None, [], user_dir()))]

    def _flag(self, arg: str) -> str | None:
        """The flag an argument sets (--name=value, --name, --noname; one dash as absl allows), or None
        (a value, or no flag's name)."""
        if not arg.startswith("-"):
            return None
        name = arg.lstrip("-").split("=", 1)[0]
        if name.startswith("no") and not self.names_flag(name) and self.names_flag(name[2:]):
            return name[2:]
        return name if self.names_flag(name) else None

    def _expand(self, args, where, stack, here):
        """args: (argument, line number or None) of one level; `where` its flagfile (None: the
        command line), `here` the directory its nested flagfiles are looked up in first."""
        out, given = [], set()  # given: the flags this level set so far
        args = iter(args)
        for arg, line in args:
            at = "the command line" if where is None else f"{where}:{line}"
            if arg.lstrip("-") == "flagfile" or arg.lstrip("-").startswith("flagfile="):
                name = arg.split("=", 1)[1] if "=" in arg else next(args, (None,))[0]
                if not name:
                    raise ValueError(f"{at}: --flagfile needs a file name")
                path = self._find(os.path.expanduser(name), here, at)
                if path in stack:
                    raise ValueError(f"--flagfile={name} ({at}) includes itself: {' -> '.join(stack + [path])}")
                text = read_text(path, f"--flagfile={name}")
                expanded = self._expand(self._lines(text, name), name, stack + [path], os.path.dirname(path))
                sets = {self._flag(a) for a, _ in expanded} - {None}
                if sets & given:
                    raise ValueError(f"{', '.join('--' + f for f in sorted(sets & given))} given before "
                                     f"--flagfile={name}, which sets it again (the later value wins): put "
                                     f"--flagfile={name} first" + ("" if where is None else f" ({at})"))
                out += expanded  # (its flags are no `given`: a later flagfile may override them, as typed ones do)
                continue
            flag = self._flag(arg)
            if flag:
                given.add(flag)
                if where is None:
                    self.sources.pop(flag, None)
                else:
                    self.sources[flag] = where
            out.append((arg, line))
        return out

    def _find(self, name: str, here: str, at: str) -> str:
        dirs = dict.fromkeys([here, user_dir(), self.search] if not os.path.isabs(name) else [""])  # (each once)
        for d in dirs:
            if os.path.exists(os.path.join(d, name)):
                return os.path.abspath(os.path.join(d, name))
        looked = f" in {' or '.join(dirs)}" if not os.path.isabs(name) else ""
        raise ValueError(f"--flagfile={name}: not found{looked}" + ("" if at == "the command line" else f" ({at})"))

    @staticmethod
    def _lines(text: str, name: str):
        """(argument, line number) for each flag line of a flagfile."""
        for n, line in enumerate(text.splitlines(), 1):
            line = re.sub(r"\s+#.*$", "", line.replace(r"\#", "\0")).replace("\0", "#").strip()  # (\# is a #)
            if not line or line.startswith(("#", "//")):
                continue
            if not line.startswith("-"):
                raise ValueError(f"--flagfile={name}:{n}: {line!r} is not a flag (expected --name=value, one a line)")
            yield line, n


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
    looked = " and ".join(dict.fromkeys([user_dir(), REPO]))  # (once, where the user works in the repository)
    raise ValueError(f"--{flag}={value}: not found (looked in {looked})")


def pick_device(name: str) -> str:
    """--device: auto picks CUDA when there is one."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device=cuda: this torch build or machine has no CUDA device")
    return name


def slow_dtype_note(device: str, dtype: torch.dtype) -> str | None:
    """What to tell a user who trains in bf16 on a CPU without bf16 instructions: PyTorch's CPU
    kernels then convert element by element (measured on this repository's 2-core AMD EPYC, the
    bundled GLM-5 run: 75 tokens/s in bf16, 795 in float32)."""
    if device != "cpu" or dtype != torch.bfloat16:
        return None
    if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        return None
    return ("--dtype=bfloat16 on a CPU without bf16 instructions (AVX512-BF16 or AMX): PyTorch runs it about 10x "
            "slower than --dtype=float32 here")


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
