"""The step loop, the model container and the optimizer make no torch compute call of their own:
everything they compute goes through an op.

A TorchFunctionMode records every torch function and tensor method called during one
training step. Each call is attributed to the innermost frame of v4train's own code: calls
from inside an op's reference (v4train/reference/) are that op's business; calls from the
step, the model container, the op table or the optimizer must be on the allowed list
(backward, scalar reads, moving data in). This proves where the compute is *called from*;
how much of it runs in C++ is test_flop_share.py's number.
"""

import os

import torch
from torch.overrides import TorchFunctionMode

import train
from golden_cases import BASE, CHAT, REPO
from v4train import data, hf_checkpoint, lora, ops
from v4train.optim import AdamW
from v4train.tokenizer import Tokenizer

V4TRAIN = os.path.join(REPO, "py")
REFERENCE = os.path.join(V4TRAIN, "v4train", "reference") + os.sep
# backward; scalar reads; moving data in (torch.tensor); reading and zeroing .grad; grad-mode switches.
ALLOWED = {"backward", "item", "tensor", "__get__", "__set__", "_set_grad_enabled"}


class Recorder(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.violations = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        import inspect

        frame = inspect.currentframe().f_back
        while frame is not None and not frame.f_code.co_filename.startswith(V4TRAIN):
            frame = frame.f_back
        name = getattr(func, "__name__", str(func))
        if frame is not None and not frame.f_code.co_filename.startswith(REFERENCE) and name not in ALLOWED:
            where = f"{os.path.relpath(frame.f_code.co_filename, REPO)}:{frame.f_lineno}"
            self.violations.append(f"{name} from {where}")
        return func(*args, **(kwargs or {}))


def test_step_loop_makes_no_torch_compute_call_outside_an_op():
    model, _ = hf_checkpoint.load(BASE)
    table = ops.resolve("all")
    model.use_ops(table)
    adapters = lora.add_adapters(model, lora.LoraConfig(4, 8, 0.0, ("q_a_proj", "o_proj"), True), torch.float32, "cpu", 0)
    records = data.read_records(CHAT, Tokenizer(BASE))[:6]
    optimizer = AdamW(adapters, table)
    recorder = Recorder()
    with recorder:
        loss, grad_norm, tokens = train.train_step(model, optimizer, [records[:3], records[3:]], 1e-3, 1.0, "cpu")
    assert recorder.violations == [], "\n".join(recorder.violations)
    assert loss > 0 and grad_norm > 0 and tokens == sum(len(r.input_ids) for r in records)


def test_the_recorder_would_catch_a_compute_call_in_the_step(monkeypatch):
    original = train.train_step

    def leaky(model, optimizer, micro, lr, max_grad_norm, device):
        out = original(model, optimizer, micro, lr, max_grad_norm, device)
        torch.ones(2).sum()  # what must never be in the step
        return out

    model, _ = hf_checkpoint.load(BASE)
    adapters = lora.add_adapters(model, lora.LoraConfig(4, 8, 0.0, ("o_proj",), False), torch.float32, "cpu", 0)
    records = data.read_records(CHAT, Tokenizer(BASE))[:2]
    recorder = Recorder()
    with recorder:
        leaky(model, AdamW(adapters, ops.REFERENCE), [records], 1e-3, 1.0, "cpu")
    assert any(v.startswith("ones from py/tests/test_train_step.py") for v in recorder.violations), recorder.violations
