"""Datasets: JSONL records, checked line by line with file:line in every error.

Record forms (the trainer issue adds the ones that need a tokenizer's chat template):
  {"input_ids": [...], "labels": [...]?}   pre-tokenized, used exactly as given; labels
                                           default to input_ids, -100 = no loss.
"""

from __future__ import annotations

import dataclasses
import json


class DataError(ValueError):
    pass


@dataclasses.dataclass
class Record:
    input_ids: list[int]
    labels: list[int]
    where: str  # file:line


TOKENIZED_FORMS = ("input_ids",)
TEXT_FORMS = ("messages", "prompt", "text")


def read_tokenized(path: str, vocab_size: int | None = None) -> list[Record]:
    """Pre-tokenized records of a JSONL file; every malformed line is reported with its number."""
    records, problems = [], []
    try:
        f = open(path)
    except OSError as e:
        raise DataError(f"{path}: cannot open ({e.strerror})") from None
    with f:
        for n, line in enumerate(f, 1):
            where = f"{path}:{n}"
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                problems.append(f"{where}: not valid JSON ({e.msg})")
                continue
            if not isinstance(obj, dict):
                problems.append(f"{where}: expected a JSON object, got {type(obj).__name__}")
                continue
            if "input_ids" not in obj:
                form = next((k for k in TEXT_FORMS if k in obj), None)
                problems.append(f"{where}: " + (f"'{form}' records need a tokenizer, which this entry point does not "
                                                f"take yet; give pre-tokenized 'input_ids'" if form else
                                                f"no 'input_ids' (keys: {sorted(obj)})"))
                continue
            ids, labels = obj["input_ids"], obj.get("labels", obj["input_ids"])
            if not (isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
                problems.append(f"{where}: input_ids must be a non-empty list of integers")
                continue
            if not (isinstance(labels, list) and len(labels) == len(ids) and all(isinstance(t, int) for t in labels)):
                problems.append(f"{where}: labels must be a list of integers as long as input_ids ({len(ids)})")
                continue
            if vocab_size is not None and not all(0 <= t < vocab_size for t in ids):
                problems.append(f"{where}: input_ids must lie in [0, {vocab_size}) (the model's vocab_size)")
                continue
            if vocab_size is not None and not all(t == -100 or 0 <= t < vocab_size for t in labels):
                problems.append(f"{where}: labels must be -100 or lie in [0, {vocab_size})")
                continue
            records.append(Record(ids, labels, where))
    if problems:
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise DataError(f"{path}: {len(problems)} malformed record(s):\n  " + "\n  ".join(problems[:20]) + more)
    if not records:
        raise DataError(f"{path}: no records")
    return records
