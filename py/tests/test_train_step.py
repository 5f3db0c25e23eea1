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

from v4train import trainer as train
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
        result = train.train_step(model, optimizer, [records[:3], records[3:]], 1e-3, 1.0, "cpu")
    assert recorder.violations == [], "\n".join(recorder.violations)
    assert result.loss > 0 and result.grad_norm > 0 and result.tokens == sum(len(r.input_ids) for r in records)


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


def test_a_nonfinite_step_applies_no_update_and_names_the_gradients_that_hold_it():
    model, _ = hf_checkpoint.load(BASE)
    table = ops.resolve("all")
    model.use_ops(table)
    adapters = lora.add_adapters(model, lora.LoraConfig(4, 8, 0.0, ("o_proj",), True), torch.float32, "cpu", 0)
    for w in model.parameters():
        w.requires_grad_(False)
    for t in adapters.values():
        t.requires_grad_(True)
    records = data.read_records(CHAT, Tokenizer(BASE))[:2]
    optimizer = AdamW(adapters, table)
    before = {n: t.clone() for n, t in {**adapters, **optimizer.state_tensors()}.items()}
    norm = model.get_parameter("model.norm.weight")
    healthy = norm.detach().clone()
    with torch.no_grad():
        norm.fill_(1e38)  # finite, but the logits overflow: the loss is NaN
    result = train.train_step(model, optimizer, [records], 1e-3, 1.0, "cpu")
    assert not result.finite and result.loss != result.loss
    assert result.nonfinite[0] == "model.layers.0.self_attn.o_proj.lora_A"
    assert result.nonfinite == [n for n in adapters if n in result.nonfinite], "in model order"
    after = {**adapters, **optimizer.state_tensors()}
    assert all(torch.equal(after[n], t) for n, t in before.items()), "no parameter or moment changed"
    assert optimizer.step_count == 0 and all(t.grad is None for t in adapters.values())
    with torch.no_grad():
        norm.copy_(healthy)
    result = train.train_step(model, optimizer, [records], 1e-3, 1.0, "cpu")
    assert result.finite and result.nonfinite == [] and optimizer.step_count == 1
    assert not torch.equal(adapters["model.layers.0.self_attn.o_proj.lora_B"],
                           before["model.layers.0.self_attn.o_proj.lora_B"]), "a finite step updates"
