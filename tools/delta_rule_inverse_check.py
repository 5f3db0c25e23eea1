"""A CPU check behind issue 18's plan for the delta rule's kernels (docs/gpu.md, fourth session): can
a chunk store only the gate-free inverse (I + strict(diag(beta) K K^T))^-1, in bf16, and rebuild the
gated one, (I + strict(diag(beta) K K^T * L))^-1 with L_ij = exp(G_i - G_j), elementwise as
inverse_ij * L_ij? (The gates are a diagonal similarity, D = diag(exp(G)); forming D and D^-1 apart
would overflow at Qwen3.5's decays, so the rebuild is by element.) For unit keys and beta in (0, 1),
drawn with correlations up to 0.999 and decays from slow to Qwen3.5's strongest, it prints the
largest entry of the gate-free inverse and the relative error, against the float64 gated inverse, of
the gated inverse rounded to bf16 (what storing it costs today) and of the bf16 gate-free one regated.

    python3 tools/delta_rule_inverse_check.py
"""

import torch

N, D = 64, 128  # a chunk; Qwen3.5's key width


def draw(gen, corr: float, beta_shift: float, decay: float):
    base = torch.randn(D, dtype=torch.float64, generator=gen)
    k = corr * base + (1 - corr) * torch.randn(N, D, dtype=torch.float64, generator=gen)
    k = k / k.norm(dim=-1, keepdim=True)
    beta = torch.sigmoid(beta_shift + torch.randn(N, dtype=torch.float64, generator=gen))
    g = -decay * torch.nn.functional.softplus(torch.randn(N, dtype=torch.float64, generator=gen))
    return k, beta, g.cumsum(0)


def inverse(k, beta, gates):
    """(I + strict(diag(beta) K K^T * gates))^-1 in k's dtype."""
    return torch.linalg.inv(torch.eye(N, dtype=k.dtype) + torch.tril(beta[:, None] * (k @ k.T) * gates, -1))


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    lower = torch.tril(torch.ones(N, N, dtype=torch.float64))
    print("| key correlation | beta | decay scale | max gate-free entry | bf16 gated | bf16 gate-free, regated |")
    print("|---|---|---|---|---|---|")
    for corr, beta_shift, decay in [(0.0, 0.0, 0.05), (0.0, 0.0, 8.0), (0.5, 0.0, 1.0), (0.9, 0.0, 0.05),
                                    (0.9, 0.0, 8.0), (0.99, 4.0, 0.05), (0.999, 8.0, 0.05)]:
        largest, err_gated, err_free = 0.0, 0.0, 0.0
        for _ in range(20):
            k, beta, G = draw(gen, corr, beta_shift, decay)
            L = torch.exp((G[:, None] - G[None, :]).clamp(max=0)) * lower
            truth = inverse(k, beta, L)
            free = inverse(k.float(), beta.float(), torch.ones(N, N))
            largest = max(largest, free.abs().max().item())
            gated = inverse(k.float(), beta.float(), L.float()).bfloat16().double()
            err_gated = max(err_gated, ((gated - truth).norm() / truth.norm()).item())
            regated = free.bfloat16().double() * L
            err_free = max(err_free, ((regated - truth).norm() / truth.norm()).item())
        print(f"| {corr} | sigmoid({beta_shift} + N(0, 1)) | {decay} | {largest:.3g} | {err_gated:.2e} | {err_free:.2e} |")


if __name__ == "__main__":
    main()
