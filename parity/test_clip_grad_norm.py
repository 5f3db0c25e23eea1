"""v4_clip_grad_norm against torch.nn.utils.clip_grad_norm_."""

import pytest
import torch

from v4train.testing.compare import assert_close
from v4train.ops import OPS

OP = OPS["v4_clip_grad_norm"]


@pytest.mark.parametrize("impl", ["reference", "cpp"])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_matches_torch_clip_grad_norm(impl, max_norm):
    fn = OP.reference if impl == "reference" else OP.cpp()
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in [(5, 4), (9,), (2, 3, 4)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    grads = [p.grad.clone() for p in params]
    expected_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    norm = fn(grads, max_norm)
    assert_close(norm, expected_norm, "norm")
    for i, (g, p) in enumerate(zip(grads, params)):
        assert_close(g, p.grad, f"grad {i}")


def test_zero_max_norm_measures_without_clipping():
    grads = [torch.full((4,), 3.0)]
    assert_close(OP.cpp()(grads, 0.0), torch.tensor(6.0), "norm")
    assert torch.equal(grads[0], torch.full((4,), 3.0))


def _sharded_worker(rank: int, size: int, init: str, impl: str) -> None:
    import os

    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # (a sandbox's hostname may not resolve)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=size)
    try:
        fn = OP.reference if impl == "reference" else OP.cpp()
        gen = torch.Generator().manual_seed(2)
        whole = [torch.randn(s, generator=gen) for s in [(6, 4), (9,), (4, 3), (5,)]]
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in whole]
        for p, g in zip(params, whole):
            p.grad = g.clone()
        expected_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        # Each rank holds rows of each gradient, as FSDP2's shards do (rank 1 none of the second's);
        # the last is on both ranks whole (a replicated expert's): two copies, counted once.
        part = lambda i, g: g if i == 3 else g[rank::size] if i != 1 else (g if rank == 0 else g[:0])  # noqa: E731
        shards = [part(i, g).clone() for i, g in enumerate(whole)]
        norm = fn(shards, 1.0, dist.group.WORLD.group_name, [1, 1, 1, 2])
        assert_close(norm, expected_norm, f"norm over {size} ranks")
        for i, (s, p) in enumerate(zip(shards, params)):
            assert_close(s, part(i, p.grad), f"clipped shard {i}")
        dist.barrier()  # both done before either tears the group down
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("impl", ["reference", "cpp"])
def test_the_norm_of_shards_over_ranks_is_the_whole_gradients(impl, tmp_path):
    """With a group's name the gradients are each rank's shards, or copies of one on several ranks:
    the norm and the clipping are those of the whole gradients (2 gloo processes)."""
    import torch.multiprocessing as mp

    mp.spawn(_sharded_worker, args=(2, str(tmp_path / "init"), impl), nprocs=2, join=True)
