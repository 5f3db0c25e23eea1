"""A causal LM of either family: a container of weights (by transformers name) plus functions.

The forward pass is embed -> one op call per decoder layer -> final norm -> LM-head loss, every
step through v4train.ops, so the C++ path swaps the functions and keeps the weights. Batches
are packed: all tokens back to back with document boundaries (see `Packed`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.utils.checkpoint import checkpoint

from v4train import ops
from v4train.models import glm5, qwen3_5
from v4train.models.config import Glm5Config, ModelConfig
from v4train.models.weights import WeightSpec, init_tensor
from v4train.reference.cross_entropy_loss import IGNORE_INDEX


@dataclasses.dataclass
class Packed:
    """Tokens of several documents back to back.

    input_ids [T] int64; targets [T] int64: the token that follows t in its document, or -100
    for no loss (the last token of a document, prompt tokens); positions [T], restarting at 0
    at each document; cu_seqlens [N + 1] int64 on the CPU: document boundaries.
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor

    @staticmethod
    def from_documents(docs: list[list[int]], labels: list[list[int]] | None = None, device="cpu") -> "Packed":
        """Documents of token ids, with optional per-token labels (-100 = no loss; default: the
        ids themselves), shifted as transformers does with labels = input_ids: position t
        predicts labels[t + 1] of the same document."""
        ids, tg, pos, cu = [], [], [], [0]
        for i, doc in enumerate(docs):
            lab = doc if labels is None else labels[i]
            if len(lab) != len(doc):
                raise ValueError(f"document {i}: {len(doc)} ids but {len(lab)} labels")
            ids += doc
            tg += list(lab[1:]) + [IGNORE_INDEX]
            pos += range(len(doc))
            cu.append(cu[-1] + len(doc))
        as_long = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
        return Packed(as_long(ids), as_long(tg), as_long(pos), torch.tensor(cu, dtype=torch.int64))

    @staticmethod
    def from_rows(input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> "Packed":
        """A [B, S] batch, one document per row (what transformers' forward sees)."""
        rows = input_ids.tolist()
        return Packed.from_documents(rows, None if labels is None else labels.tolist(), device=input_ids.device)

    @property
    def num_targets(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())


def family(cfg: ModelConfig):
    return glm5 if isinstance(cfg, Glm5Config) else qwen3_5


def global_specs(cfg: ModelConfig) -> list[WeightSpec]:
    V, H = cfg.vocab_size, cfg.hidden_size
    specs = [WeightSpec("model.embed_tokens.weight", (V, H)),
             WeightSpec("model.norm.weight", (H,), "ones" if isinstance(cfg, Glm5Config) else "zeros")]
    if not cfg.tie_word_embeddings:
        specs.append(WeightSpec("lm_head.weight", (V, H)))
    return specs


def all_specs(cfg: ModelConfig) -> list[WeightSpec]:
    """Every tensor of the model, with full transformers names (model.layers.{i}.*)."""
    specs = global_specs(cfg)
    for i in range(cfg.num_hidden_layers):
        specs += [dataclasses.replace(s, name=f"model.layers.{i}.{s.name}") for s in family(cfg).layer_specs(cfg, i)]
    return specs


class CausalLM:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], hf_config: dict):
        self.cfg = cfg
        self.hf_config = hf_config  # config.json as read (or as it will be written)
        self.weights = weights
        expected = {s.name for s in all_specs(cfg)}
        if set(weights) != expected:
            missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
            raise ValueError(f"CausalLM: weights do not match the config: missing {missing[:5]}, unexpected {extra[:5]}")
        self.checkpointing = False  # recompute each layer in the backward pass (gradient checkpointing)
        self.layers = [
            {s.name: weights[f"model.layers.{i}.{s.name}"] for s in family(cfg).layer_specs(cfg, i)}
            for i in range(cfg.num_hidden_layers)
        ]

    @staticmethod
    def empty(cfg: ModelConfig, hf_config: dict) -> "CausalLM":
        """The model on the meta device: shapes only, no memory."""
        weights = {s.name: torch.empty(s.shape, device="meta") for s in all_specs(cfg)}
        return CausalLM(cfg, weights, hf_config)

    @staticmethod
    def random(cfg: ModelConfig, hf_config: dict, dtype: torch.dtype, device="cpu", seed: int = 0) -> "CausalLM":
        """Freshly initialised weights, created straight in `dtype` on `device`."""
        gen = torch.Generator().manual_seed(seed)
        weights = {s.name: init_tensor(s, dtype, device, gen) for s in all_specs(cfg)}
        return CausalLM(cfg, weights, hf_config)

    @property
    def lm_head(self) -> torch.Tensor:
        return self.weights["model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"]

    def named_parameters(self):
        return self.weights.items()

    def parameters(self) -> list[torch.Tensor]:
        return list(self.weights.values())

    def hidden_states(self, batch: Packed) -> torch.Tensor:
        """The final-norm hidden states [T, H]."""
        cfg = self.cfg
        x = ops.v4_embedding(batch.input_ids, self.weights["model.embed_tokens.weight"])
        recompute = self.checkpointing and torch.is_grad_enabled()
        if isinstance(cfg, Glm5Config):
            topk = None
            for i, w in enumerate(self.layers):
                args = (x, w, cfg, i, batch.positions, batch.cu_seqlens, topk)
                x, topk = checkpoint(ops.v4_glm5_layer_forward, *args, use_reentrant=False) if recompute \
                    else ops.v4_glm5_layer_forward(*args)
        else:
            for i, w in enumerate(self.layers):
                args = (x, w, cfg, i, batch.positions, batch.cu_seqlens)
                x = checkpoint(ops.v4_qwen3_5_layer_forward, *args, use_reentrant=False) if recompute \
                    else ops.v4_qwen3_5_layer_forward(*args)
        return ops.v4_rms_norm(x, self.weights["model.norm.weight"], cfg.rms_norm_eps, not isinstance(cfg, Glm5Config))

    def logits(self, batch: Packed) -> torch.Tensor:
        return torch.nn.functional.linear(self.hidden_states(batch), self.lm_head)

    def loss(self, batch: Packed, normalizer: float = 1.0) -> torch.Tensor:
        """Next-token cross-entropy summed over the batch's targets, / normalizer (fp32 scalar)."""
        return ops.v4_cross_entropy_loss(self.hidden_states(batch), self.lm_head, batch.targets, normalizer)
