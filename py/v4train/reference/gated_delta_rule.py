"""The gated delta rule of Gated DeltaNet, two ways (cf. flash-linear-attention's naive.py).

`recurrent` is the ground truth, one token at a time; `chunked` is the chunk-parallel form
(chunk 64, a UT transform inside each chunk, a scan across chunks) that the C++ op will mirror.
Both match transformers' torch_recurrent_gated_delta_rule / torch_chunk_gated_delta_rule.

Shapes: q, k [B, L, Hk, Dk]; v [B, L, Hv, Dv]; g (log decay, <= 0), beta [B, L, Hv]; Hv a
multiple of Hk (key head h serves value heads h*r .. h*r + r - 1). Everything runs in fp32
(float64 for float64 inputs);
q and k are L2-normalised (eps 1e-6) and q is scaled by Dk^-0.5. For each head:
    S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t
Returns (o [B, L, Hv, Dv] in q's dtype, final state [B, Hv, Dk, Dv] fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _prepare(q, k, v, g, beta):
    rep = v.shape[2] // k.shape[2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    compute = torch.promote_types(q.dtype, torch.float32)
    q, k, v, beta = [x.transpose(1, 2).to(compute, memory_format=torch.contiguous_format) for x in (q, k, v, beta)]
    g = g.transpose(1, 2).to(torch.promote_types(g.dtype, compute))  # a float64 g stays float64 (see chunked)
    q = q * torch.rsqrt((q * q).sum(dim=-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt((k * k).sum(dim=-1, keepdim=True) + 1e-6)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def recurrent(q, k, v, g, beta, initial_state=None):
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    B, H, L, Dk = k.shape
    state = torch.zeros(B, H, Dk, v.shape[-1]).to(v) if initial_state is None else initial_state.to(v)
    outs = []
    for t in range(L):
        state = state * g[:, :, t].exp()[..., None, None]
        delta = (v[:, :, t] - (state * k[:, :, t, :, None]).sum(dim=-2)) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append((state * q[:, :, t, :, None]).sum(dim=-2))
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(B, H, 0, v.shape[-1])
    return o.transpose(1, 2).contiguous().to(out_dtype), state


# The sites of chunked's products, as it names them to mm.
PRODUCT_SITES = ("k_kt", "q_kt", "w_state", "q_state", "intra_v_new", "kt_v_new")
# The sites at which chunked reads g (its cumulative log decay G), beta and the normalised k and q,
# as it names them to path(x, leaf, site); a leaf's gradient is the sum of what reaches it through
# its sites. G: the decay matrix of the UT system and of Q K^T, the decay to the chunk's start of w's
# keys and of q, k's decay to the chunk's end, the state's decay across a chunk's end. beta: v's
# weights (the values' side of the system) and k's, in the system's matrix and in w's right-hand
# side. k: both sides of the system's K K^T, w's right-hand side, Q K^T, the state's update (K~). q:
# Q K^T and the state's product (Q S).
PATH_SITES = {"g": ("system", "intra", "w", "q", "k", "state"), "beta": ("v", "system", "w"),
              "k": ("system", "w", "intra", "state"), "q": ("intra", "state")}


def _matmul(a, b, site: str):
    return torch.matmul(a, b)


def _path(x, leaf: str, site: str):
    return x


def _store(x, name: str):
    return x


def chunked(q, k, v, g, beta, initial_state=None, chunk_size: int = 64, mm=_matmul, decay_state=torch.mul,
            path=_path, store=_store):
    # mm(a, b, site): every matrix product, named; decay_state(state, factor): the state's decay at a
    # chunk's end, whose gradient to the factor is the state's dot with the next state's gradient
    # (tools/delta_rule_split_check.py passes emulations of the kernels' products, per site, and of
    # that dot on stored states); path(x, leaf, site): g's cumulative log decay G, beta, k and q as
    # each of their PATH_SITES reads them (the parity suite cuts one, x detached there, to judge the
    # leaf's gradient along that path); store(x, name): u, w and v_new as a kernel would store them between
    # its passes (the split check rounds them, or their gradients, to bf16)
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    B, H, L, Dk = k.shape
    Dv = v.shape[-1]
    pad = (chunk_size - L % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    n = (L + pad) // chunk_size
    made = {}  # each factor once per tensors the hook returns (by default the same ones at every site)

    def once(kind, xs, make):
        key = (kind, *map(id, xs))
        if key not in made:
            made[key] = xs, make(*xs)  # (xs kept, so that their ids are not reused)
        return made[key][1]

    chunks = lambda x: x.reshape(B, H, n, chunk_size, x.shape[-1])  # noqa: E731

    def read(x, leaf, site):  # x (k or q) in chunks as the site reads it
        return once("chunks", (path(x, leaf, site),), chunks)

    v_beta = chunks(v * path(beta, "beta", "v")[..., None])
    k_beta = {site: once("k_beta", (path(beta, "beta", site), path(k, "k", site)),
                         lambda b, x: chunks(x * b[..., None])) for site in ("system", "w")}
    # The cumulative log decay inside each chunk, summed, differenced and (but for the decay matrix)
    # exponentiated in float64: in fp32 the differences of sums of up to 64 log decays lose digits, and the
    # A_log / dt_bias gradients, which sum them with cancellation, came out up to 19% off the exact
    # answer (as transformers' fp32 rule does); float64 autograd accumulates their gradient.
    compute = q.dtype
    g = g.reshape(B, H, n, chunk_size).double().cumsum(dim=-1)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)

    def decay(site):  # [.., i, j]: exp(G_i - G_j) for j <= i
        return once("decay", (path(g, "g", site),), lambda G: (G[..., :, None] - G[..., None, :]).to(compute)
                    .masked_fill(upper, float("-inf")).exp())

    def to_start(site):
        return once("to_start", (path(g, "g", site),), lambda G: G.exp().to(compute)[..., None])

    # UT transform: (I + tril(diag(beta) K K^T, -1)) solved once per chunk for the values and keys.
    system = mm(k_beta["system"], read(k, "k", "system").transpose(-1, -2), "k_kt") * decay("system")
    intra = mm(read(q, "q", "intra"), read(k, "k", "intra").transpose(-1, -2), "q_kt") * decay("intra")
    u = store(torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True), "u")
    w = store(torch.linalg.solve_triangular(system, k_beta["w"] * to_start("w"), upper=False, unitriangular=True), "w")
    state = torch.zeros(B, H, Dk, Dv).to(v) if initial_state is None else initial_state.to(v)
    q = read(q, "q", "state") * to_start("q")
    G = path(g, "g", "k")
    k = read(k, "k", "state") * (G[..., -1:] - G).exp().to(compute)[..., None]
    chunk_decay = path(g, "g", "state")[..., -1].exp().to(compute)[..., None, None]
    outs = []
    for i in range(n):
        v_new = store(u[:, :, i] - mm(w[:, :, i], state, "w_state"), "v_new")
        outs.append(mm(q[:, :, i], state, "q_state") + mm(intra[:, :, i], v_new, "intra_v_new"))
        state = decay_state(state, chunk_decay[:, :, i]) + mm(k[:, :, i].transpose(-1, -2), v_new, "kt_v_new")
    o = torch.stack(outs, dim=2).reshape(B, H, -1, Dv)[:, :, :L] if outs else v.new_zeros(B, H, 0, Dv)
    return o.transpose(1, 2).contiguous().to(out_dtype), state


def v4_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        cu_seqlens: torch.Tensor, *, mm=_matmul, decay_state=torch.mul,
                        path=_path, store=_store) -> torch.Tensor:
    """The gated delta rule over packed documents, each from a zero state: `chunked` per document.

    q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; cu_seqlens int64 [N + 1]. Returns o [T, Hv, Dv]
    in q's dtype (fp32 math; float64 for float64 inputs, the parity suite's exact answer). A
    positive g is refused: the chunked form would take exp of sums of up to 64 of them.
    """
    if (g > 0).any():
        raise ValueError(f"v4_gated_delta_rule: g is a log decay and must be <= 0 (Gated DeltaNet's -exp(A_log) "
                         f"softplus(a + dt_bias)), got a largest value of {g.max().item()}")
    bounds = cu_seqlens.tolist()
    outs = [chunked(q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e], beta[None, s:e], mm=mm,
                    decay_state=decay_state, path=path, store=store)[0][0]
            for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    if not outs:  # no tokens: an empty result that is still a function of every input
        compute = torch.promote_types(q.dtype, torch.float32)
        return (v.to(compute) * 0 + (q.sum() + k.sum() + g.sum() + beta.sum()).to(compute) * 0).to(q.dtype)
    return torch.cat(outs)
