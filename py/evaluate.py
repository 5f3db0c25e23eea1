"""//py:evaluate: the mean token loss of a Hugging Face checkpoint on a JSONL dataset.

    tools/bazel run //py:evaluate -- --model_dir=DIR --data=FILE.jsonl [--adapter_dir=DIR] [--dtype=float32]

The loss is the mean next-token cross-entropy over all target tokens of all records (what
transformers computes with labels = input_ids, or with the record's labels). Each record is its
own document; records are packed into batches of up to --max_batch_tokens tokens, which changes
nothing in the result. The last line printed is one JSON object with at least `loss` and
`tokens` (the number of target tokens).
"""

from __future__ import annotations

import os
import signal


def _interrupted_at_start(signum, frame):  # until main() starts: no traceback from inside an import
    os.write(2, b"\nevaluate: interrupted before the run started; nothing was written\n")
    os._exit(128 + signum)


signal.signal(signal.SIGINT, _interrupted_at_start)
signal.signal(signal.SIGTERM, _interrupted_at_start)

import collections
import json
import sys
import time

import torch
from absl import app, flags

from v4train import cli, hf_checkpoint, lora, ops
from v4train.data import DataError, read_records
from v4train.models import ops_of
from v4train.tokenizer import Tokenizer

FLAGS = flags.FLAGS
flags.DEFINE_string("model_dir", None, "Hugging Face checkpoint directory (config.json + safetensors).")
flags.DEFINE_string("data", None, "JSONL file of records with 'input_ids' and optional 'labels' (-100 = no loss).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Dtype of the weights and activations.")
flags.DEFINE_enum("device", "auto", ["auto", "cpu", "cuda"], "Where to run; auto picks CUDA when available.")
flags.DEFINE_string("cpp_ops", "all", "Ops to run in C++: 'all' (every op with a C++ implementation), 'none' or a comma list (see v4train.ops.OPS).")
flags.DEFINE_string("adapter_dir", None, "A PEFT LoRA adapter (e.g. OUTPUT_DIR/checkpoint-STEP of a LoRA run) to apply.")
flags.DEFINE_string("tokenizer_dir", None, "tokenizer.json (+ chat template) for text records; default: --model_dir.")
flags.DEFINE_enum("fp8", "keep", ["keep", "dequantize"],
                  "An FP8 checkpoint's weights: kept in FP8 on the device (the C++ ops dequantise them as they use "
                  "them) or dequantised into --dtype on load.")
flags.DEFINE_integer("max_batch_tokens", 8192, "Most tokens per forward pass (whole records are never split).",
                     lower_bound=1)


def evaluate(model_dir: str, data: str, dtype: torch.dtype, device: str, max_batch_tokens: int,
             adapter_dir: str | None = None, tokenizer_dir: str | None = None,
             table: ops.OpTable = ops.REFERENCE, fp8: str = "keep") -> dict:
    model, report = hf_checkpoint.load(model_dir, dtype, device, fp8)
    # What the model's own weights take on the device, before any adapter: bytes and tensors by dtype.
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weight_dtypes = dict(collections.Counter(str(p.dtype).removeprefix("torch.") for p in model.parameters()))
    model.use_ops(table)
    if adapter_dir:
        lora.load_peft(model, adapter_dir, dtype, device)
    tokenizer_dir = tokenizer_dir or model_dir
    tokenizer = Tokenizer(tokenizer_dir) if os.path.exists(os.path.join(tokenizer_dir, "tokenizer.json")) else None
    records = read_records(data, tokenizer, model.cfg.vocab_size)
    start = time.time()
    loss, targets = cli.mean_loss(model, records, max_batch_tokens, device)
    if targets == 0:
        raise DataError(f"{data}: no target tokens (every label is -100 or every record has one token)")
    return {"loss": loss, "tokens": targets, "records": len(records),
            "model_type": model.cfg.model_type, "dtype": str(dtype).removeprefix("torch."), "device": device,
            "skipped_tensors": report["skipped"], "seconds": round(time.time() - start, 3),
            "weight_bytes": weight_bytes, "weight_dtypes": weight_dtypes, "cpp_ops": ops_of(model.cfg, table.cpp)}


def main(argv):
    # From here a SIGINT is a KeyboardInterrupt again, one line below.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    for name in ("model_dir", "data"):
        if not getattr(FLAGS, name):
            raise app.UsageError(f"--{name} is required")
    try:
        table = ops.resolve(FLAGS.cpp_ops)
        path = lambda flag, directory=True: getattr(FLAGS, flag) and cli.input_path(flag, getattr(FLAGS, flag),  # noqa: E731
                                                                                    directory)
        result = evaluate(path("model_dir"), path("data", False), getattr(torch, FLAGS.dtype),
                          cli.pick_device(FLAGS.device), FLAGS.max_batch_tokens, path("adapter_dir"), path("tokenizer_dir"),
                          table, FLAGS.fp8)
    except (ValueError, ops.CppOpUnavailable) as e:  # ConfigError, CheckpointError, DataError are ValueErrors
        print(f"evaluate: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # loading or evaluating: nothing is written, so nothing to keep
        print("\nevaluate: interrupted before it finished; nothing was written", file=sys.stderr)
        return 128 + signal.SIGINT
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    cli.run_app("evaluate", main, sys.argv)
