"""Expert parallelism in the MoE ops (v4_glm5_moe, v4_qwen3_5_moe), over gloo on the CPU (the code
path of NCCL): 2 processes, each holding half of the routed experts and its own tokens, give each
rank the outputs and every gradient that one process with all the experts gives for the same
tokens. The gradients of the weights every rank holds (router, shared expert) are each rank's own
tokens' share, which summed over the ranks (as data-parallel sync does) is the whole one."""

from __future__ import annotations

import dataclasses
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from v4train import ops
from v4train.layer_call import ExpertParallel
from v4train.models.glm5.moe import Glm5MoeWeights
from v4train.models.qwen3_5.moe import Qwen35MoeWeights
from v4train.reference.lora import Linear
from v4train.reference.mlp import MlpWeights
from v4train.reference.moe import ExpertsWeights
from v4train.testing.compare import assert_close

E, H, INTER, R, TOP_K = 4, 16, 8, 2, 2
TOKENS = (7, 12)  # each rank's own, unequal: the all-to-all's splits differ per rank


def _leaf(shape, gen, scale=0.3) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).requires_grad_()


def _experts(gen) -> ExpertsWeights:
    return ExpertsWeights(Linear(_leaf((E, 2 * INTER, H), gen), None, _leaf((E, R, H), gen), _leaf((E, 2 * INTER, R), gen)),
                          Linear(_leaf((E, H, INTER), gen), None, _leaf((E, R, INTER), gen), _leaf((E, H, R), gen)))


def _shared(gen) -> MlpWeights:
    return MlpWeights(Linear(_leaf((INTER, H), gen)), Linear(_leaf((INTER, H), gen)), Linear(_leaf((H, INTER), gen)))


def _weights(family: str):
    gen = torch.Generator().manual_seed(0)
    if family == "glm5":
        return Glm5MoeWeights(_leaf((E, H), gen), torch.zeros(E, dtype=torch.float64), _experts(gen), _shared(gen))
    return Qwen35MoeWeights(_leaf((E, H), gen), _experts(gen), _shared(gen), _leaf((1, H), gen))


def _call(table, family, x, weights, ep=None):
    if family == "glm5":
        return table.v4_glm5_moe(x, weights, TOP_K, 2, 2, True, 2.5, 2.0, 0.0, None, ep)[0]
    return table.v4_qwen3_5_moe(x, weights, TOP_K, True, 2.0, 0.0, None, ep)[0]


def _leaves(w) -> dict[str, torch.Tensor]:
    """Every tensor of a weights dataclass that takes a gradient, by dotted field name."""
    out = {}
    for f in dataclasses.fields(w):
        v = getattr(w, f.name)
        if dataclasses.is_dataclass(v):
            out.update({f"{f.name}.{k}": t for k, t in _leaves(v).items()})
        elif isinstance(v, torch.Tensor) and v.requires_grad:
            out[f.name] = v
    return out


def _this_rank(w, rank: int, size: int):
    """w with the routed experts cut to rank's E / size (fresh leaves), the rest fresh copies."""
    def cut(v, name=""):
        if dataclasses.is_dataclass(v):
            return dataclasses.replace(v, **{f.name: cut(getattr(v, f.name), f"{name}{f.name}.")
                                             for f in dataclasses.fields(v)})
        if not isinstance(v, torch.Tensor):
            return v
        if name.startswith("experts."):
            v = v.chunk(size)[rank]
        return v.detach().clone().requires_grad_(v.requires_grad)
    return cut(w)


def _worker(rank: int, size: int, init: str, family: str, impl: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # (a sandbox's hostname may not resolve)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=size)
    try:
        table = ops.resolve(f"v4_{family}_moe") if impl == "cpp" else ops.REFERENCE
        gen = torch.Generator().manual_seed(1)
        xs = [_leaf((n, H), gen, 1.0) for n in TOKENS]
        grads = [torch.randn(n, H, generator=gen, dtype=torch.float64) for n in TOKENS]
        # One process with every expert and every rank's tokens.
        full = _weights(family)
        expected = [_call(table, family, x, full) for x in xs]
        torch.autograd.backward(expected, grads)
        # This rank: its tokens, its experts.
        mine = _this_rank(full, rank, size)
        x = xs[rank].detach().clone().requires_grad_()
        out = _call(table, family, x, mine, ExpertParallel(dist.group.WORLD.group_name, rank, size))
        out.backward(grads[rank])
        assert_close(out, expected[rank], f"{family} {impl} rank {rank}: output")
        assert_close(x.grad, xs[rank].grad, f"{family} {impl} rank {rank}: gradient of x")
        whole = _leaves(full)
        for name, leaf in _leaves(mine).items():
            want = whole[name].grad
            if name.startswith("experts."):
                want = want.chunk(size)[rank]
            else:  # each rank's share of a weight every rank holds
                dist.all_reduce(leaf.grad)
            assert_close(leaf.grad, want, f"{family} {impl} rank {rank}: gradient of {name}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("impl", ["cpp", "reference"])
@pytest.mark.parametrize("family", ["glm5", "qwen3_5"])
def test_expert_parallel_2_equals_1_process(family, impl):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init"), family, impl), nprocs=2, join=True)


def test_an_expert_parallel_size_that_does_not_divide_the_experts_is_refused():
    w = _weights("glm5")
    with pytest.raises(ValueError, match="expert_parallel .* does not fit 4 experts"):
        _call(ops.resolve("v4_glm5_moe"), "glm5", torch.randn(3, H, dtype=torch.float64), w, ExpertParallel("g", 0, 3))
