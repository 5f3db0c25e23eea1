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

from golden_cases import gloo
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


def _call(table, family, x, weights, ep=None, routing=None):
    if family == "glm5":
        return table.v4_glm5_moe(x, weights, TOP_K, 2, 2, True, 2.5, 2.0, 0.0, routing, ep)[0]
    return table.v4_qwen3_5_moe(x, weights, TOP_K, True, 2.0, 0.0, routing, ep)[0]


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
        if ".experts." in f".{name}":
            v = v.chunk(size)[rank]
        return v.detach().clone().requires_grad_(v.requires_grad)
    return cut(w)


def _compare_grads(full, mine, rank: int, size: int, what: str) -> None:
    """This rank's gradients against one process's: its experts' slice of theirs; of a weight
    every rank holds, the sum over the ranks."""
    whole = _leaves(full)
    for name, leaf in _leaves(mine).items():
        want = whole[name].grad
        if want is None:  # (the router's correction bias only chooses)
            assert leaf.grad is None, f"{what}: {name} has a gradient"
            continue
        if ".experts." in f".{name}":
            want = want.chunk(size)[rank]
        else:
            dist.all_reduce(leaf.grad)
        assert_close(leaf.grad, want, f"{what}: gradient of {name}")


def _check(call, full, rank: int, size: int, width: int, what: str) -> None:
    """call(x, weights, r, ep): the op on rank r's tokens x, with an ExpertParallel or (None) in
    one process with every expert. This rank's output and gradients against one process's."""
    gen = torch.Generator().manual_seed(1)
    xs = [_leaf((n, width), gen, 1.0) for n in TOKENS]
    grads = [torch.randn(n, width, generator=gen, dtype=torch.float64) for n in TOKENS]
    expected = [call(x, full, r, None) for r, x in enumerate(xs)]
    torch.autograd.backward(expected, grads)
    mine = _this_rank(full, rank, size)
    x = xs[rank].detach().clone().requires_grad_()
    out = call(x, mine, rank, ExpertParallel(dist.group.WORLD.group_name, rank, size))
    out.backward(grads[rank])
    assert_close(out, expected[rank], f"{what}: output")
    assert_close(x.grad, xs[rank].grad, f"{what}: gradient of x")
    _compare_grads(full, mine, rank, size, what)


def _worker(rank: int, size: int, init: str, family: str, impl: str, skewed: bool) -> None:
    with gloo(rank, size, init):
        table = ops.resolve(f"v4_{family}_moe") if impl == "cpp" else ops.REFERENCE

        def call(x, w, r, ep):
            # skewed: every token routed to experts 0 and 1, so rank 1 receives no row and its experts none
            routing = torch.tensor([[0, 1]] * x.shape[0]) if skewed else None
            return _call(table, family, x, w, ep, routing)
        _check(call, _weights(family), rank, size, H, f"{family} {impl}{' skewed' if skewed else ''} rank {rank}")


@pytest.mark.parametrize("impl", ["cpp", "reference"])
@pytest.mark.parametrize("family", ["glm5", "qwen3_5"])
def test_expert_parallel_2_equals_1_process(family, impl):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init"), family, impl, False), nprocs=2, join=True)


@pytest.mark.parametrize("impl", ["cpp", "reference"])
def test_a_rank_that_receives_no_rows_still_exchanges(impl):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init"), "glm5", impl, True), nprocs=2, join=True)


def _claims_rank_1(rank: int, size: int, init: str) -> None:
    with gloo(rank, size, init):
        ep = ExpertParallel(dist.group.WORLD.group_name, 1, size)  # rank 0 says it is rank 1
        mine = _this_rank(_weights("glm5"), 1, size)
        x = torch.randn(3, H, dtype=torch.float64)
        for table in (ops.resolve("v4_glm5_moe"), ops.REFERENCE):
            if rank == 0:
                with pytest.raises(ValueError, match="says rank 1 of 2, but this process is rank 0"):
                    _call(table, "glm5", x, mine, ep)


def test_an_expert_parallel_rank_other_than_the_process_s_is_refused():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_claims_rank_1, args=(2, os.path.join(tmp, "init")), nprocs=2, join=True)


def test_an_expert_parallel_size_that_does_not_divide_the_experts_is_refused():
    w = _weights("glm5")
    with pytest.raises(ValueError, match="expert_parallel size 3 does not divide the 4 experts"):
        _call(ops.resolve("v4_glm5_moe"), "glm5", torch.randn(3, H, dtype=torch.float64), w, ExpertParallel("g", 0, 3))


def _layer_worker(rank: int, size: int, init: str, family: str) -> None:
    """The same through a whole decoder layer op, checkpointed: its recomputation in the backward
    pass repeats the first pass's routing and exchanges the rows again on every rank."""
    import json

    from v4train.layer_call import Batch, LayerOptions
    from v4train.model import CausalLM
    from v4train.models import config_from_dict

    with gloo(rank, size, init):
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        with open(os.path.join(root, "testdata", "sft", f"{family}_config.json")) as f:
            config = json.load(f)
        cfg = config_from_dict(config, f"{family}_config.json")
        model = CausalLM.random(cfg, config, torch.float64, seed=0)
        for p in model.parameters():
            p.requires_grad_(True)
        index = 2  # an MoE layer of both test models, and one of GLM-5's with its own indexer
        op = getattr(ops.resolve(f"v4_{family}_layer_forward"), f"v4_{family}_layer_forward")
        carry = (None,) if family == "glm5" else ()

        def call(x, w, r, ep):
            batch = Batch(torch.arange(TOKENS[r]), torch.tensor([0, TOKENS[r]]))
            options = LayerOptions(checkpoint=True, expert_parallel=ep) if ep else LayerOptions()
            out = op(x, w, cfg, index, batch, options, *carry)
            return out[0] if isinstance(out, tuple) else out
        _check(call, model.layers[index].weights, rank, size, cfg.hidden_size, f"{family} layer rank {rank}")


@pytest.mark.parametrize("family", ["glm5", "qwen3_5"])
def test_a_checkpointed_layer_with_expert_parallel_2_equals_1_process(family):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_layer_worker, args=(2, os.path.join(tmp, "init"), family), nprocs=2, join=True)
