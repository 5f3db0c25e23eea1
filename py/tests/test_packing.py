"""Packed sequences: documents side by side give what each gives alone (attention never crosses a
boundary; the DeltaNet conv and state reset at each document start)."""

import pytest
import torch

from golden_cases import golden
from v4train.testing.compare import assert_rel_close
from v4train import hf_checkpoint
from v4train.model import Packed


@pytest.mark.parametrize("case", ["glm5", "qwen3_5_moe"])
def test_packed_equals_each_document_alone(case):
    model_dir, _, _ = golden(case)
    model, _ = hf_checkpoint.load(model_dir)
    gen = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, model.cfg.vocab_size, (n,), generator=gen).tolist() for n in (30, 1, 70, 17)]
    with torch.no_grad():
        packed = model.logits(Packed.from_documents(docs))
        alone = torch.cat([model.logits(Packed.from_documents([d])) for d in docs])
    assert_rel_close(packed, alone, f"{case} packed vs alone")
    # And packing is not a no-op: the same tokens as one document give other logits.
    with torch.no_grad():
        merged = model.logits(Packed.from_documents([sum(docs, [])]))
    assert (merged - alone).abs().max() > 1e-3


def test_packed_targets_never_cross_documents():
    batch = Packed.from_documents([[5, 6, 7], [8, 9]])
    assert batch.targets.tolist() == [6, 7, -100, 9, -100]
    assert batch.positions.tolist() == [0, 1, 2, 0, 1]
    assert batch.cu_seqlens.tolist() == [0, 3, 5]
    assert batch.num_targets == 3
    masked = Packed.from_documents([[5, 6, 7]], labels=[[-100, -100, 7]])
    assert masked.targets.tolist() == [-100, 7, -100]
