"""The model-level ops, one C++ call each once they have C++: embedding, one decoder layer per
family, the LM-head loss, and the optimizer's two. Each face dispatches like every op (see
registry.dispatch); each `_example` gives the trainer's self-check its inputs."""

import torch

from v4train.ops.registry import OpInfo, dispatch
from v4train.reference.adam_step import v4_adam_step as _adam
from v4train.reference.clip_grad_norm import v4_clip_grad_norm as _clip
from v4train.reference.cross_entropy_loss import v4_cross_entropy_loss as _ce
from v4train.reference.embedding import v4_embedding as _embedding
from v4train.reference.glm5_layer import v4_glm5_layer_forward as _glm5
from v4train.reference.qwen3_5_layer import v4_qwen3_5_layer_forward as _qwen3_5

_DTYPES = (torch.float32, torch.bfloat16)
_SHAPES = [(8, 16), (16,), (3, 5, 7)]


def _embedding_example(dtype, device):
    gen = torch.Generator().manual_seed(0)
    return (torch.randint(0, 40, (17,), generator=gen).to(device),
            torch.randn(40, 24, generator=gen).to(device=device, dtype=dtype))


def _ce_example(dtype, device):
    gen = torch.Generator().manual_seed(0)
    targets = torch.randint(0, 50, (12,), generator=gen)
    targets[3] = -100
    return (torch.randn(12, 16, generator=gen).to(device=device, dtype=dtype),
            (0.3 * torch.randn(50, 16, generator=gen)).to(device=device, dtype=dtype), targets.to(device), 11.0, 5)


def _adam_example(dtype, device):
    gen = torch.Generator().manual_seed(0)
    r = lambda s, scale=1.0: (torch.randn(s, generator=gen) * scale).to(device)  # noqa: E731
    return ([r(s).to(dtype) for s in _SHAPES], [r(s, 0.1).to(dtype) for s in _SHAPES], [r(s, 0.01) for s in _SHAPES],
            [r(s, 0.01).square() for s in _SHAPES], 3, 1e-3, 0.9, 0.999, 1e-8, 0.01)


def _clip_example(dtype, device):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in _SHAPES], 1.0


EMBEDDING = OpInfo("v4_embedding", _embedding, _DTYPES, example=_embedding_example)
GLM5_LAYER = OpInfo("v4_glm5_layer_forward", _glm5, _DTYPES, has_cpp=False)
QWEN3_5_LAYER = OpInfo("v4_qwen3_5_layer_forward", _qwen3_5, _DTYPES, has_cpp=False)
CROSS_ENTROPY = OpInfo("v4_cross_entropy_loss", _ce, _DTYPES, example=_ce_example)
ADAM_STEP = OpInfo("v4_adam_step", _adam, _DTYPES, inplace=True, example=_adam_example)
CLIP_GRAD_NORM = OpInfo("v4_clip_grad_norm", _clip, _DTYPES, inplace=True, example=_clip_example)


def v4_embedding(input_ids, weight):
    return dispatch(EMBEDDING)(input_ids, weight)


def v4_glm5_layer_forward(hidden, weights, cfg, layer, positions, cu_seqlens, prev_topk=None):
    return dispatch(GLM5_LAYER)(hidden, weights, cfg, layer, positions, cu_seqlens, prev_topk)


def v4_qwen3_5_layer_forward(hidden, weights, cfg, layer, positions, cu_seqlens):
    return dispatch(QWEN3_5_LAYER)(hidden, weights, cfg, layer, positions, cu_seqlens)


def v4_cross_entropy_loss(hidden, weight, targets, normalizer=1.0):
    return dispatch(CROSS_ENTROPY)(hidden, weight, targets, normalizer)


def v4_adam_step(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps, weight_decay):
    return dispatch(ADAM_STEP)(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps, weight_decay)


def v4_clip_grad_norm(grads, max_norm):
    return dispatch(CLIP_GRAD_NORM)(grads, max_norm)
