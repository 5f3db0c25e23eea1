"""v4_mla_dsa_attention at GLM-5's own attention widths (64 heads, a 576-wide latent, 32 indexer
heads of 128): the latent path and, on CUDA in bf16, its kernels (the fused indexer scores, the
sparse attention's forward and backward) against the reference, forward and every gradient.
The drawn samples of the registry cover the small and odd shapes; these the tiled ones: a
top-k that is not a whole number of the kernels' 32-key tiles, and one that is."""

import pytest
import torch

from parity.strategies import devices
from v4train.ops import OPS, REFERENCE
from v4train.ops.check import check_parity
from v4train.ops.mla_dsa_attention import glm5_width_sample

NAME = "v4_mla_dsa_attention"
CASES = [("cpu", torch.float32)] + [("cuda", dt) for dt in (torch.bfloat16, torch.float32) if "cuda" in devices()]


@pytest.mark.parametrize("device,dtype", CASES, ids=[f"{d}-{str(t).removeprefix('torch.')}" for d, t in CASES])
@pytest.mark.parametrize("tokens,top_k", [(160, 50), (300, 64)])
def test_glm5_widths_match_the_reference(device, dtype, tokens, top_k):
    sample = glm5_width_sample(dtype, device, tokens, top_k)
    check_parity(OPS[NAME], OPS[NAME].cpp(), REFERENCE[NAME], sample, seed=1)
