"""A causal LM of either family: a tree of torch.nn.Modules whose parameter names are the
transformers names (model.embed_tokens.weight, model.layers.{i}.self_attn.q_a_proj.weight, ...,
lm_head.weight), the shape FSDP2 (`fully_shard`) and DTensor attach to.

The forward pass is embed -> one op call per decoder layer -> final norm -> LM-head loss, every
step an op of the run's OpTable (`use_ops`), so the C++ path swaps the functions and keeps the
weights. Batches are packed: all tokens back to back with document boundaries (see `Packed`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from v4train import ops as ops_
from v4train.layer_call import Batch, ExpertParallel, LayerOptions
from v4train.models import family_of
from v4train.models import ModelConfig
from v4train.models.weights import WeightSpec, init_tensor
from v4train.reference.lora import bind, linear_names, scale_name
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
    def batch(self) -> Batch:
        """What a layer op needs of the batch: the positions and document boundaries."""
        return Batch(self.positions, self.cu_seqlens)

    @property
    def num_targets(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())


def global_specs(cfg: ModelConfig) -> list[WeightSpec]:
    V, H = cfg.vocab_size, cfg.hidden_size
    specs = [WeightSpec("model.embed_tokens.weight", (V, H)),
             WeightSpec("model.norm.weight", (H,), "zeros" if family_of(cfg).zero_centered_norm else "ones")]
    if not cfg.tie_word_embeddings:
        specs.append(WeightSpec("lm_head.weight", (V, H)))
    return specs


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def all_specs(cfg: ModelConfig) -> list[WeightSpec]:
    """Every tensor of the model, with full transformers names (model.layers.{i}.*)."""
    specs = global_specs(cfg)
    for i in range(cfg.num_hidden_layers):
        specs += [dataclasses.replace(s, name=layer_prefix(i) + s.name) for s in family_of(cfg).layer_specs(cfg, i)]
    return specs


def linear_map_names(cfg: ModelConfig) -> set[str]:
    """The full names of every layer's linear maps: the weights that may stay FP8 (the others the
    ops take as plain tensors, without scales)."""
    return {layer_prefix(i) + n for i in range(cfg.num_hidden_layers) for n in linear_names(family_of(cfg).layer_weights)}


def put_parameter(root: nn.Module, name: str, tensor: torch.Tensor, requires_grad: bool = False) -> nn.Parameter:
    """Registers `tensor` as the parameter `name` (dotted) under root, making plain nn.Module
    containers for the missing parents; a decoder layer on the way binds its weights anew."""
    *path, leaf = name.split(".")
    module = root
    for part in path:
        if isinstance(module, DecoderLayer):
            module.unbind()
        child = module._modules.get(part)
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    if isinstance(module, DecoderLayer):
        module.unbind()
    param = nn.Parameter(tensor, requires_grad=requires_grad)
    module.register_parameter(leaf, param)
    return param


class DecoderLayer(nn.Module):
    """One decoder layer: its tensors under their transformers names (relative to
    model.layers.{i}.), its LoRA hyperparameters, and a forward that is one op call."""

    def __init__(self, cfg: ModelConfig, index: int, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg, self.index, self.family = cfg, index, family_of(cfg)
        self._bound = None
        for name, t in tensors.items():
            put_parameter(self, name, t)
        self.lora_scaling = 0.0  # alpha / r once adapters are added (v4train.lora)
        self.lora_dropout = 0.0
        self.checkpointing = False  # recompute the layer in the backward pass (activation checkpointing)
        self.op = None  # the family's layer op from the run's OpTable (CausalLM.use_ops)
        self.sharded = False  # FSDP2 swaps its parameters (gathered, sharded): bind them at each call
        self.expert_parallel = ExpertParallel()  # its MoE's group (v4train.distributed.shard_experts)

    @property
    def weights(self):
        """The layer's tensors (its adapters among them) as its op takes them, the family's
        layer_weights: bound once, and again after a parameter is added (put_parameter) or the
        module moved (_apply); at each call when FSDP2 shards it (v4train.distributed.shard)."""
        if self._bound is None or self.sharded:  # (an expert's DTensor: this rank's experts, in the graph)
            self._bound = bind(self.family.layer_weights, {k: p.to_local() if isinstance(p, DTensor) else p
                                                           for k, p in self.named_parameters()})
        return self._bound

    def unbind(self) -> None:
        self._bound = None

    def _apply(self, fn, recurse=True):
        self.unbind()
        return super()._apply(fn, recurse)

    def forward(self, hidden: torch.Tensor, batch: Batch, carry=None):
        """(hidden, the carry to the next layer: GLM-5's DSA selection, None for Qwen3.5)."""
        options = LayerOptions(self.lora_scaling, self.lora_dropout if self.training else 0.0, self.checkpointing,
                               self.expert_parallel)
        if self.family.carries:
            return self.op(hidden, self.weights, self.cfg, self.index, batch, options, carry)
        return self.op(hidden, self.weights, self.cfg, self.index, batch, options), None


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], hf_config: dict,
                 ops: ops_.OpTable = ops_.REFERENCE):
        """tensors: every tensor of all_specs(cfg) by full name (the meta device gives shapes only),
        and beside a layer's float8 weight kept in FP8 its scales (NAME_scale_inv, frozen)."""
        super().__init__()
        self.cfg, self.family = cfg, family_of(cfg)
        self.hf_config = hf_config  # config.json as read (or as it will be written)
        expected = [s.name for s in all_specs(cfg)]
        fp8 = [n for n in expected if n in tensors and tensors[n].dtype == torch.float8_e4m3fn]
        maps = linear_map_names(cfg)
        if any(n not in maps for n in fp8):  # a router or norm in FP8 would be used without its scales
            raise ValueError(f"CausalLM: {next(n for n in fp8 if n not in maps)} is float8, but only a layer's "
                             "linear maps can stay FP8: dequantise it")
        scales = {scale_name(n) for n in fp8}
        allowed = set(expected) | scales
        if set(tensors) != allowed:
            missing, extra = sorted(allowed - set(tensors)), sorted(set(tensors) - allowed)
            raise ValueError(f"CausalLM: weights do not match the config: missing {missing[:5]}, unexpected {extra[:5]}")
        for s in global_specs(cfg):
            put_parameter(self, s.name, tensors[s.name])
        self.model.layers = nn.ModuleList(
            DecoderLayer(cfg, i, {n: tensors[layer_prefix(i) + n] for s in self.family.layer_specs(cfg, i)
                                  for n in (s.name, scale_name(s.name)) if layer_prefix(i) + n in tensors})
            for i in range(cfg.num_hidden_layers))
        self.use_ops(ops)

    @property
    def checkpointing(self) -> bool:
        return all(layer.checkpointing for layer in self.model.layers)

    @checkpointing.setter
    def checkpointing(self, on: bool) -> None:
        """Activation checkpointing of every layer: only its input is kept for the backward pass."""
        for layer in self.model.layers:
            layer.checkpointing = on

    def use_ops(self, table: ops_.OpTable) -> None:
        """Computes with the ops of `table` from now on."""
        self.ops = table
        for layer in self.model.layers:
            layer.op = table[self.family.layer_op]

    @staticmethod
    def empty(cfg: ModelConfig, hf_config: dict) -> "CausalLM":
        """The model on the meta device: shapes only, no memory."""
        return CausalLM(cfg, {s.name: torch.empty(s.shape, device="meta") for s in all_specs(cfg)}, hf_config)

    @staticmethod
    def random(cfg: ModelConfig, hf_config: dict, dtype: torch.dtype, device="cpu", seed: int = 0) -> "CausalLM":
        """Freshly initialised weights, created straight in `dtype` on `device`."""
        gen = torch.Generator().manual_seed(seed)
        return CausalLM(cfg, {s.name: init_tensor(s, dtype, device, gen) for s in all_specs(cfg)}, hf_config)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def weights(self) -> dict[str, torch.Tensor]:
        """The model's own tensors (no adapters) by full transformers name, in all_specs order."""
        return {s.name: self.get_parameter(s.name) for s in all_specs(self.cfg)}

    @property
    def fp8(self) -> bool:
        """Whether it holds weights kept in FP8 (hf_checkpoint.load(..., fp8="keep"))."""
        return any(p.dtype == torch.float8_e4m3fn for p in self.parameters())

    def hidden_states(self, batch: Packed) -> torch.Tensor:
        """The final-norm hidden states [T, H]."""
        ops = self.ops
        x = ops.v4_embedding(batch.input_ids, self.model.embed_tokens.weight)
        carry, layer_batch = None, batch.batch
        for layer in self.model.layers:
            x, carry = layer(x, layer_batch, carry)
        return ops.v4_rms_norm(x, self.model.norm.weight, self.cfg.rms_norm_eps, self.family.zero_centered_norm)

    def logits(self, batch: Packed) -> torch.Tensor:
        return torch.nn.functional.linear(self.hidden_states(batch), self.lm_head_weight)

    def loss(self, batch: Packed, normalizer: float = 1.0) -> torch.Tensor:
        """Next-token cross-entropy summed over the batch's targets, / normalizer (fp32 scalar)."""
        return self.ops.v4_cross_entropy_loss(self.hidden_states(batch), self.lm_head_weight, batch.targets, normalizer)
