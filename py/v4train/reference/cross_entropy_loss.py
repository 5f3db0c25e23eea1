import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def v4_cross_entropy_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          normalizer: float = 1.0, chunk_tokens: int = 4096) -> torch.Tensor:
    """Next-token cross-entropy of the LM head, summed and divided by `normalizer`, in float32.

    sum over t with targets[t] != -100 of -log softmax(hidden[t] W^T)[targets[t]], / normalizer.
    hidden [T, H], weight [V, H] (lm_head), targets [T] int64 (already shifted: the token that
    follows t in its document). Logits are formed in the model dtype and upcast to fp32, as
    transformers' ForCausalLMLoss does, a chunk of tokens at a time so that the full [T, V]
    fp32 logits never exist at once in the forward pass. The caller divides by the number of
    target tokens.
    """
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_tokens):
        logits = F.linear(hidden[start:start + chunk_tokens], weight).float()
        total = total + F.cross_entropy(logits, targets[start:start + chunk_tokens],
                                        ignore_index=IGNORE_INDEX, reduction="sum")
    return total / normalizer
