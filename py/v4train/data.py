"""Datasets: JSONL records -> token ids and labels -> packed micro-batches.

Record forms (one per line):
  {"messages": [{"role": ..., "content": ...}, ...]}   chat: the tokenizer's chat template is
                                                       applied; loss on assistant tokens only
  {"prompt": "...", "completion": "..."}               loss on the completion (+ eos) only
  {"text": "..."}                                      loss on every token (+ eos)
  {"input_ids": [...], "labels": [...]?}               pre-tokenized, used exactly as given;
                                                       labels default to input_ids, -100 = no loss
Every malformed line (not UTF-8, not JSON, a lone surrogate, a bad record) is reported with
file:line, all of them in one error; a compressed file is refused as a whole.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random

from v4train.reference.cross_entropy_loss import IGNORE_INDEX as IGNORE
from v4train.tokenizer import NotPrefixes


class DataError(ValueError):
    pass


@dataclasses.dataclass
class Record:
    input_ids: list[int]
    labels: list[int]
    where: str  # file:line

    @property
    def num_targets(self) -> int:
        """Tokens that are predicted: label t + 1 is the target of position t."""
        return sum(1 for t in self.labels[1:] if t != IGNORE)


def _ints(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _parse(obj, tokenizer) -> tuple[list[tuple[list[int], list[int]]], str | None]:
    """([(input_ids, labels)] of one record, or of each assistant turn of a conversation whose
    template rewrites earlier turns (Tokenizer.encode_turns); what the run should note of it:
    "per_turn", "unterminated" (no eos_token to end it) or None); raises ValueError with what is
    wrong."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if "input_ids" in obj:
        ids, labels = obj["input_ids"], obj.get("labels", obj["input_ids"])
        if not (_ints(ids) and ids):
            raise ValueError("input_ids must be a non-empty list of integers")
        if not (_ints(labels) and len(labels) == len(ids)):
            raise ValueError(f"labels must be a list of integers as long as input_ids ({len(ids)})")
        return [(ids, labels)], None
    form = next((k for k in ("messages", "prompt", "text") if k in obj), None)
    if form is None:
        raise ValueError(f"expected one of messages, prompt/completion, text, input_ids; got keys {sorted(obj)}")
    if tokenizer is None:
        raise _NeedsTokenizer(form)
    eos = [tokenizer.token_id(tokenizer.eos_token)] if tokenizer.eos_token else []
    if form == "messages":
        msgs = obj["messages"]
        if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                         and isinstance(m.get("content"), str) for m in msgs)):
            raise ValueError("messages must be a non-empty list of {role: str, content: str}")
        if not any(m["role"] == "assistant" for m in msgs):
            raise ValueError("messages has no assistant message (nothing to learn)")
        try:
            encoded, note = [tokenizer.encode_chat(msgs)], None
        except NotPrefixes:
            encoded, note = tokenizer.encode_turns(msgs), "per_turn"
        return [(ids, [t if m else IGNORE for t, m in zip(ids, mask)]) for ids, mask in encoded], note
    note = None if eos else "unterminated"
    if form == "prompt":
        if not (isinstance(obj.get("prompt"), str) and isinstance(obj.get("completion"), str)):
            raise ValueError("prompt and completion must both be strings")
        p, c = tokenizer.encode(obj["prompt"]), tokenizer.encode(obj["completion"]) + eos
        return [(p + c, [IGNORE] * len(p) + c)], note
    if not isinstance(obj["text"], str) or not obj["text"]:
        raise ValueError("text must be a non-empty string")
    ids = tokenizer.encode(obj["text"]) + eos
    return [(ids, list(ids))], note


class _NeedsTokenizer(ValueError):
    """A text record without a tokenizer: one problem of the file, reported once."""


def _text(raw: bytes) -> str:
    """A line as text; raises ValueError saying where it is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line)") from None


def _no_lone_surrogates(obj) -> None:
    """JSON's \\uD800-\\uDFFF escapes can encode half a UTF-16 pair, which is not text (the tokenizer
    cannot take it): every string of the record must encode as UTF-8."""
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"a string holds a lone surrogate (U+{ord(e.object[e.start]):04X}), which is not text") from None


def _grouped(problems: list[str], path: str) -> list[str]:
    """'path:LINE: message' problems with the same message as one: 'path:FIRST (and N more lines):
    message' (a chat template that refuses every record is one problem, not one per line)."""
    by_message: dict[str, list[str]] = {}
    for p in problems:
        where, sep, message = p.partition(": ") if p.startswith(path + ":") else (p, "", "")
        by_message.setdefault(message if sep else p, []).append(where if sep else "")
    return [f"{wheres[0]} (and {len(wheres) - 1} more line(s) alike): {m}" if len(wheres) > 1 and wheres[0] else
            (f"{wheres[0]}: {m}" if wheres[0] else m) for m, wheres in by_message.items()]


def read_records(path: str, tokenizer=None, vocab_size: int | None = None, notes: list[str] | None = None
                 ) -> list[Record]:
    """The records of a JSONL file (the forms of the module's docstring); every malformed line is
    listed in one DataError. `notes` gets what the run should say (a tokenizer with no eos_token)."""
    records, problems, untokenized, noted = [], [], {}, {"per_turn": [], "unterminated": []}
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DataError(f"{path}: cannot open ({e.strerror})") from None
    with f:
        # (peeked, not read and sought back: a pipe or FIFO, `--data=<(zcat d.jsonl.gz)`, has no seek)
        if f.peek(2)[:2] == b"\x1f\x8b":
            raise DataError(f"{path}: a gzip-compressed file; give the JSONL uncompressed (gunzip it first)")
        for n, raw in enumerate(f, 1):
            where = f"{path}:{n}"
            try:
                line = _text(raw)
                if not line.strip():
                    continue
                obj = json.loads(line)
                _no_lone_surrogates(obj)
                parsed, note = _parse(obj, tokenizer)
                for ids, labels in parsed if vocab_size is not None else ():
                    if not all(0 <= t < vocab_size for t in ids):
                        if isinstance(obj, dict) and "input_ids" not in obj:  # the tokenizer's ids, not the record's
                            raise ValueError(f"the tokenizer of {tokenizer.directory} ({tokenizer.vocab_size} ids) "
                                             f"gives ids past the model's vocab_size, {vocab_size}: a tokenizer of "
                                             "another model? (--tokenizer_dir, or the model directory's own)")
                        raise ValueError(f"input_ids must lie in [0, {vocab_size}) (the model's vocab_size)")
                    if not all(t == IGNORE or 0 <= t < vocab_size for t in labels):
                        raise ValueError(f"labels must be -100 or lie in [0, {vocab_size})")
            except json.JSONDecodeError as e:
                problems.append(f"{where}: not valid JSON ({e.msg})")
                continue
            except RecursionError:
                problems.append(f"{where}: nested too deeply to read (a record is an object of lists and strings)")
                continue
            except _NeedsTokenizer as e:
                untokenized.setdefault(str(e), []).append(n)
                continue
            except ValueError as e:
                problems.append(f"{where}: {e}")
                continue
            records += [Record(ids, labels, where) for ids, labels in parsed]
            if note:
                noted[note].append(n)
    for form, lines in untokenized.items():
        problems.insert(0, f"{path}: {len(lines)} '{form}' record(s), the first at line {lines[0]}, need a tokenizer: give "
                           "--tokenizer_dir (a folder with tokenizer.json), or pre-tokenized 'input_ids' records")
    count, problems = len(problems) + sum(len(lines) - 1 for lines in untokenized.values()), _grouped(problems, path)
    if len(problems) == 1:
        raise DataError(problems[0])
    if problems:
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise DataError(f"{path}: {count} malformed records:\n  " + "\n  ".join(problems[:20]) + more)
    if not records:
        raise DataError(f"{path}: no records")
    split, unterminated = noted["per_turn"], noted["unterminated"]
    if split and notes is not None:
        notes.append(f"{path}: {len(split)} conversation(s), the first at line {split[0]}, each trained as one example "
                     f"per assistant turn: the chat template of {tokenizer.directory} renders earlier turns otherwise "
                     "than when they were written (e.g. without their reasoning), so each turn is learned on the "
                     "conversation as the model sees it when it writes that turn")
    if unterminated and notes is not None:
        notes.append(f"{path}: {len(unterminated)} prompt/completion or text record(s), the first at line "
                     f"{unterminated[0]}, end with no end-of-sequence token: {tokenizer.directory}'s "
                     "tokenizer_config.json names no eos_token, so the model does not learn to stop; set one there")
    return records


@dataclasses.dataclass
class Prepared:
    examples: list[Record]
    truncated: int
    dropped: int

    @property
    def num_targets(self) -> int:
        return sum(r.num_targets for r in self.examples)


def fit_to_length(records: list[Record], max_len: int, overlong: str, what: str) -> Prepared:
    """Truncates (keeps the first max_len tokens) or drops records longer than max_len; `what`
    names the limit in the error (--seq_len=1024, max_position_embeddings=4096)."""
    out, truncated, dropped = [], 0, 0
    for r in records:
        if len(r.input_ids) <= max_len:
            out.append(r)
        elif overlong == "truncate":
            out.append(Record(r.input_ids[:max_len], r.labels[:max_len], r.where))
            truncated += 1
        else:
            dropped += 1
    prepared = Prepared(out, truncated, dropped)
    if not out:
        raise DataError(f"every one of the {dropped} examples is longer than {max_len} tokens ({what}) and was "
                        "dropped (--overlong=drop): raise --seq_len, or --overlong=truncate")
    if prepared.num_targets == 0:
        raise DataError("the dataset has no trainable token (every label is -100 after "
                        f"{'truncation' if overlong == 'truncate' else 'dropping'} to {max_len} tokens, {what})")
    return prepared


def rows(examples: list[Record], seq_len: int, packing: bool) -> list[list[Record]]:
    """Rows of the epoch: with packing, consecutive examples fill rows of up to seq_len tokens;
    without, one example per row."""
    if not packing:
        return [[r] for r in examples]
    out, row, used = [], [], 0
    for r in examples:
        if row and used + len(r.input_ids) > seq_len:
            out.append(row)
            row, used = [], 0
        row.append(r)
        used += len(r.input_ids)
    if row:
        out.append(row)
    return out


class Loader:
    """Micro-batches of `batch_rows` rows, reshuffled every epoch from (seed, epoch).

    Its position (epoch, next row) is part of every checkpoint, so a resumed run sees exactly
    the batches the uninterrupted run would have.
    """

    def __init__(self, examples: list[Record], seq_len: int, packing: bool, batch_rows: int, seed: int):
        self.examples, self.seq_len, self.packing, self.batch_rows, self.seed = examples, seq_len, packing, batch_rows, seed
        self.epoch, self.cursor, self._fingerprint = 0, 0, None
        self._rows = self._epoch_rows()

    def _epoch_rows(self, epoch: int | None = None):
        order = list(range(len(self.examples)))
        random.Random(self.seed * 1000003 + (self.epoch if epoch is None else epoch)).shuffle(order)
        return rows([self.examples[i] for i in order], self.seq_len, self.packing)

    @property
    def batches_per_epoch(self) -> int:
        return -(-len(self._rows) // self.batch_rows)

    def next(self) -> list[Record]:
        """The documents of the next micro-batch (rows concatenated)."""
        if self.cursor >= len(self._rows):
            self.epoch, self.cursor = self.epoch + 1, 0
            self._rows = self._epoch_rows()
        batch = self._rows[self.cursor:self.cursor + self.batch_rows]
        self.cursor += self.batch_rows
        return [doc for row in batch for doc in row]

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "data": self.fingerprint()}

    def fingerprint(self) -> dict:
        """What the position means: the examples (their count, tokens and a digest of their ids and
        labels, in file order) and how they are laid out in rows. A resume on other data, or another
        --seq_len or --packing, would take up a position in batches it never saw."""
        if self._fingerprint is None:  # (once: every checkpoint saves it)
            digest = hashlib.sha256()
            for r in self.examples:
                digest.update(json.dumps([r.input_ids, r.labels], separators=(",", ":")).encode())
            self._fingerprint = {"examples": len(self.examples), "tokens": sum(len(r.input_ids) for r in self.examples),
                                 "sha256": digest.hexdigest()[:16], "seq_len": self.seq_len, "packing": self.packing}
        return dict(self._fingerprint)

    def position_after(self, micro_batches: int) -> tuple[int, int]:
        """(epoch, cursor) after `micro_batches` calls of next() from the start (an epoch's row
        count depends on its shuffle when packing, so each epoch is counted)."""
        epoch, left = 0, micro_batches
        while True:
            rows = len(self._epoch_rows(epoch))
            batches = -(-rows // self.batch_rows)
            if left <= batches:
                return epoch, left * self.batch_rows
            epoch, left = epoch + 1, left - batches

    def load_state(self, state: dict, micro_batches: int | None = None) -> None:
        """A position saved by state(), checked against this loader's data and batch size, and,
        given `micro_batches` (the next() calls the saved run made: step x --grad_accum), equal
        to the position they reach (ValueError naming the field)."""
        epoch, cursor = (state.get("epoch"), state.get("cursor")) if isinstance(state, dict) else (None, None)
        if not _count(epoch) or not _count(cursor):
            raise ValueError(f"expected {{\"epoch\", \"cursor\"}} of integers >= 0, got {state!r}")
        saved, own = state.get("data"), self.fingerprint()  # (checkpoints before it have none)
        if saved is not None and saved != own:
            differ = ", ".join(f"{k} {saved.get(k)!r} there, {own[k]!r} here" for k in own if saved.get(k) != own[k])
            raise ValueError(f"the checkpoint was made on other data or rows ({differ}): resume with its --data, "
                             "--seq_len and --packing, or start afresh in another --output_dir")
        rows = len(self._epoch_rows(epoch))
        if cursor % self.batch_rows or cursor >= rows + self.batch_rows:
            raise ValueError(f"cursor {cursor} is not a position of this data in micro-batches of {self.batch_rows} "
                             f"({rows} rows an epoch): was the checkpoint made with other --data, "
                             "--seq_len or --micro_batch_size?")
        expected = self.position_after(micro_batches) if micro_batches is not None else (epoch, cursor)
        if (epoch, cursor) != expected:
            raise ValueError(f"epoch {epoch}, cursor {cursor} is not where {micro_batches} micro-batches of "
                             f"{self.batch_rows} rows end (epoch {expected[0]}, cursor {expected[1]}): was the "
                             "checkpoint made with other --data, --seq_len, --micro_batch_size or --grad_accum?")
        self.epoch, self.cursor = epoch, cursor
        self._rows = self._epoch_rows()


def _count(x) -> bool:
    """An integer >= 0 (not a bool, not a float)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0
