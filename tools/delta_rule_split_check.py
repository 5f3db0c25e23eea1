"""A CPU check behind issue 18's next kernels (docs/gpu.md, fifth session): are the delta rule's
products precise enough when each operand is split into two bfloat16 parts, x = hi + lo with
hi = bf16(x) and lo = bf16(x - hi), and a b ~ ah bh + (ah bl + al bh) accumulated in float32? That is
three bf16 tensor-core products where the kernels take six TF32 ones today, from operands that cost
the bytes of float32 in shared memory. Every product inside the reference's chunked rule, forward and
backward, is emulated so (the triangular solves stay float32); each output and gradient of
v4_gated_deltanet (whose A_log and dt_bias gradients sum the log decay's with cancellation: fla
issue 640's kind) and of v4_gated_delta_rule is judged as the parity suite judges bf16 results
(v4train.testing.check.judge against the float64 truth), beside the kernels' split today (TF32,
both parts truncated) and plain bf16 operands (fla's precision, the variant that should fail).
With --each, also every product site of the chunked rule (reference/gated_delta_rule.py names
them) alone in plain bf16, the others split: which products a kernel may take as one bf16 product
where the planes take three; --plain a,b judges those sites in plain bf16 together. --stored h,d_state
adds to that variant the states as a kernel would store them, rounded to bf16, in the one place that
reads them outside a product: the chunk decay's gradient, the dot of the state before a chunk's end
(h) with the gradient of the state after it (d_state), accumulated in float32. That dot is zero
before a document's first chunk end and after its last, so the drawn samples reach it only in
documents of 129 tokens or more, few and narrow: --long judges v4_gated_delta_rule on the long
documents of parity/test_gated_delta_rule.py instead (1, 63, 64, 65 and 4,097 tokens, widths 128,
the slow decay under which the state crosses chunks; one seed a sample), where a dot 1% off fails.
--stored u,v_new: the values U and v_new as a kernel would store them between its passes (fla's
bf16), rounded wherever they are read, their gradients passed unrounded (both bf16 on planes: U since
the thirty-fifth session, when 500 samples gave A_log's worst error as without it, 7.46 times the
reference's, and the long documents g's gradient 4.51-4.91e-3 from float32's against 4.03-4.41e-3). --stored dv_local,dv_new:
v_new's gradient from the chunk's own outputs, and its whole gradient, as the backward kernels
would store them (both bf16 on planes: dv_new since 2bc5023, dv_local since the thirty-fourth session,
when 500 samples gave A_log's worst error as without it, 7.46 times the reference's, and the long
documents g's gradient 4.03-4.41e-3 from float32's against 4.02-4.37e-3). --stored dw: W's
gradient -(dv_new h^T), which dqkwg writes and wy_grads reads (bf16 on planes since 665ad86),
rounded to bf16 where it reaches W.
A last column measures each variant's g gradient from the kernels' own rounding (the --plain
sites, the --stored states) as a distance over its norm: where the bf16 judge's bound is too wide
to see a dot some percent off (--off: that variant too), the built op (--cpp, on --device: the CUDA
kernels) should sit as close to its own rounding as the emulation's float32 order allows
(docs/gpu.md, item 6 of the eleventh session).

--flashqla adds FlashQLA's formulation (flashqla_chunked: Ar without the gate stored in bf16, every
product bf16, the state read in bf16), and the same with Q K^T exact as this project's kernels form it
from the raw rows: the forty-first session's 500 samples failed 4 (A_log's and dt_bias's gradients, as
plain bf16 does) and 0 (A_log's worst error 7.52 times the reference's, the planes kernels' 7.46).

    python3 tools/delta_rule_split_check.py [--samples 500] [--ops v4_gated_deltanet,v4_gated_delta_rule]
    python3 tools/delta_rule_split_check.py --each --samples 200
    python3 tools/delta_rule_split_check.py --plain w_state,q_state,kt_v_new --stored h,d_state --long --samples 5
    python3 tools/delta_rule_split_check.py --plain w_state,q_state,kt_v_new --long --off 0.01 --cpp --device cuda
    python3 tools/delta_rule_split_check.py --flashqla --samples 500
"""

from __future__ import annotations

import argparse
import functools
import random

import torch

from v4train.models.qwen3_5.deltanet import v4_gated_deltanet
from v4train.ops import REFERENCE, resolve
from v4train.reference.gated_delta_rule import PRODUCT_SITES, _prepare, v4_gated_delta_rule
from v4train.testing.cases import CASES
from v4train.testing.cases.gated_delta_rule import ScaledGradient, long_documents
from v4train.testing.check import (Spreads, _compare, forward_backward, in_float64, low_precision_bound,
                                   upstream_of)
from v4train.testing.samples import RandomDraw


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def tf32(x: torch.Tensor) -> torch.Tensor:
    """x truncated to TF32 (the top 19 bits a tensor core reads), as the kernels' split() does."""
    return (x.contiguous().view(torch.int32) & -8192).view(torch.float32)


def product(a: torch.Tensor, b: torch.Tensor, split: str) -> torch.Tensor:
    if split == "float32":
        return a @ b
    if split == "bf16":
        return bf16(a) @ bf16(b)
    part = bf16 if split == "bf16x3" else tf32
    ah, bh = part(a), part(b)
    al, bl = part(a - ah), part(b - bh)
    return ah @ bh + (ah @ bl + al @ bh)  # the cross terms accumulated apart, as the kernels do


class Product(torch.autograd.Function):
    """a @ b with the forward's and the backward's products emulated by `split`; b's gradient rounded
    to bf16 where `round_db` (a kernel that stores it so)."""

    @staticmethod
    def forward(ctx, a, b, split, round_db=False):
        ctx.save_for_backward(a, b)
        ctx.split, ctx.round_db = split, round_db
        return product(a, b, split)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        da = product(grad, b.transpose(-1, -2), ctx.split) if ctx.needs_input_grad[0] else None
        db = product(a.transpose(-1, -2), grad, ctx.split) if ctx.needs_input_grad[1] else None
        return da, (bf16(db) if ctx.round_db and db is not None else db), None, None


# u and v_new: the values, as the reference's store hook names them; dv_local: the gradient of v_new
# from the chunk's own outputs (P^T d_o, the backward of site intra_v_new: local_grads' output);
# dv_new: v_new's whole gradient (the folded reverse recurrence's output), rounded where it reaches
# v_new, so for every use (the kernels' reverse recurrence multiplies with the same bf16 values it
# stores); dw: W's gradient, rounded where it reaches W.
STORED = ("h", "d_state", "u", "v_new", "dv_local", "dv_new", "dw")


class Rounded(torch.autograd.Function):
    """x rounded to bf16 as a kernel stores it (or as it is, without `round_value`); the gradient
    passes as it is, or rounded to bf16 where `round_grad` (dv_new, dw)."""

    @staticmethod
    def forward(ctx, x, round_value=True, round_grad=False):
        ctx.round_grad = round_grad
        return bf16(x) if round_value else x.clone()

    @staticmethod
    def backward(ctx, grad):
        return (bf16(grad) if ctx.round_grad else grad), None, None


class StoredDecay(torch.autograd.Function):
    """state * factor, the factor's gradient the float32 dot of the states in `stored` rounded to bf16."""

    @staticmethod
    def forward(ctx, state, factor, stored):
        ctx.save_for_backward(state, factor)
        ctx.stored = stored
        return state * factor

    @staticmethod
    def backward(ctx, grad):
        state, factor = ctx.saved_tensors
        h = bf16(state) if "h" in ctx.stored else state
        d = bf16(grad) if "d_state" in ctx.stored else grad
        return grad * factor, (h * d).sum(dim=(-2, -1), keepdim=True).to(factor.dtype), None


class Ops:
    """The reference op table with the delta rule's products emulated, `split` of each site, the
    states in `stored` rounded to bf16 where the chunk decay's gradient reads them, and that gradient
    `off` of the way off (the reference's path hook at g's site "state")."""

    def __init__(self, split, stored=(), off=0.0):
        def mm(a, b, site):
            return Product.apply(a, b, split(site), site == "intra_v_new" and "dv_local" in stored)

        def decay_state(state, factor):
            return StoredDecay.apply(state, factor, stored) if stored else state * factor

        def path(x, leaf, site):
            return ScaledGradient.apply(x, 1 + off) if off and (leaf, site) == ("g", "state") else x

        def store(x, name):
            grad = (name == "v_new" and "dv_new" in stored) or (name == "w" and "dw" in stored)
            return Rounded.apply(x, name in stored, grad) if name in stored or grad else x

        self.v4_gated_delta_rule = functools.partial(v4_gated_delta_rule, mm=mm, decay_state=decay_state, path=path,
                                                     store=store)

    def __getattr__(self, name):
        return getattr(REFERENCE, name)


class UnitLowerInverse(torch.autograd.Function):
    """(I + A)^-1 of a strictly lower A, in float32, as FlashQLA's kkt_solve forms it; its backward
    -Ar^T dAr Ar^T (strictly lower) with bf16 operands, as its WY backward takes it."""

    @staticmethod
    def forward(ctx, a):
        eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device).expand_as(a)
        ar = torch.linalg.solve_triangular(eye + a, eye, upper=False, unitriangular=True)
        ctx.save_for_backward(ar)
        return ar

    @staticmethod
    def backward(ctx, grad):
        (ar,) = ctx.saved_tensors
        return -product(product(ar.transpose(-1, -2), grad, "bf16"), ar.transpose(-1, -2), "bf16").tril(-1)


def flashqla_chunked(q, k, v, g, beta, chunk_size: int = 64, exact_qk: bool = False):
    """The chunked rule as FlashQLA (QwenLM/FlashQLA, docs/gpu.md, forty-first session) computes it:
    Ar = (I + strictly lower(diag(beta) K K^T))^-1 without the gate, stored in bf16, the gated matrix
    formed as Gamma * (Ar diag(beta)); v_new = Ag (V - e^G * (K S)) from the state S (fp32, read as
    bf16); every product of bf16 operands, the backward's too (autograd through Product). The cumulative
    gate in float64, as the reference and this project's kernels keep it."""
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    B, H, L, Dk = k.shape
    Dv = v.shape[-1]
    pad = (chunk_size - L % chunk_size) % chunk_size
    q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (torch.nn.functional.pad(x, (0, pad)) for x in (beta, g))
    n = (L + pad) // chunk_size
    chunks = lambda x: x.reshape(B, H, n, chunk_size, x.shape[-1])  # noqa: E731
    q, k, v, beta = chunks(q), chunks(k), chunks(v), beta.reshape(B, H, n, chunk_size)
    compute = q.dtype
    G = g.reshape(B, H, n, chunk_size).double().cumsum(dim=-1)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    gamma = (G[..., :, None] - G[..., None, :]).masked_fill(upper, float("-inf")).exp().to(compute)  # Gamma
    e_g, to_end = G.exp().to(compute)[..., None], (G[..., -1:] - G).exp().to(compute)[..., None]
    mm = lambda a, b: Product.apply(a, b, "bf16")  # noqa: E731
    kkt = mm(k, k.transpose(-1, -2))
    ar = Rounded.apply(UnitLowerInverse.apply((beta[..., :, None] * kkt).tril(-1)))  # stored in bf16
    ag = gamma * (ar * beta[..., None, :])
    pg = gamma * (q @ k.transpose(-1, -2) if exact_qk else mm(q, k.transpose(-1, -2)))
    state = torch.zeros(B, H, Dk, Dv, dtype=compute, device=q.device)
    outs = []
    for i in range(n):
        vd = mm(ag[:, :, i], v[:, :, i] - e_g[:, :, i] * mm(k[:, :, i], state))
        outs.append(e_g[:, :, i] * mm(q[:, :, i], state) + mm(pg[:, :, i], vd))
        state = state * G[:, :, i, -1].exp().to(compute)[..., None, None] + mm(k[:, :, i].transpose(-1, -2),
                                                                             to_end[:, :, i] * vd)
    o = torch.stack(outs, dim=2).reshape(B, H, -1, Dv)[:, :, :L]
    return o.transpose(1, 2).contiguous().to(out_dtype)


def flashqla_rule(q, k, v, g, beta, cu_seqlens, exact_qk: bool = False):
    """v4_gated_delta_rule's contract (packed documents, each from a zero state) on flashqla_chunked."""
    bounds = cu_seqlens.tolist()
    return torch.cat([flashqla_chunked(q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e], beta[None, s:e],
                                       exact_qk=exact_qk)[0] for s, e in zip(bounds[:-1], bounds[1:]) if e > s])


class FlashQlaOps:
    """The reference op table with flashqla_rule for the delta rule (v4_gated_deltanet's ops)."""

    def __init__(self, exact_qk: bool):
        self.v4_gated_delta_rule = functools.partial(flashqla_rule, exact_qk=exact_qk)

    def __getattr__(self, name):
        return getattr(REFERENCE, name)


def candidate(op: str, split, stored=(), off=0.0):
    ops = Ops(split, stored, off)
    return ops.v4_gated_delta_rule if op == "v4_gated_delta_rule" else functools.partial(v4_gated_deltanet, ops=ops)


def distance(x: torch.Tensor, to: torch.Tensor) -> float:
    return ((x.double() - to.double()).norm() / to.double().norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=500, help="bf16 samples of each op (RandomDraw(0), ...)")
    parser.add_argument("--ops", default="v4_gated_deltanet,v4_gated_delta_rule")
    parser.add_argument("--each", action="store_true", help="also each site alone in plain bf16, the others bf16x3")
    parser.add_argument("--plain", default="", help="comma list of sites in plain bf16 together, the others bf16x3")
    parser.add_argument("--stored", default="", help="with --plain: comma list of the states (h, d_state) read "
                        "rounded to bf16 by the chunk decay's gradient, and of the values (u, v_new) rounded to bf16 "
                        "wherever they are read, and of v_new's and W's gradients (dv_local, dv_new, dw) rounded "
                        "where they are stored")
    parser.add_argument("--long", action="store_true", help="v4_gated_delta_rule on long documents (seeds 0, 1, ...) "
                        "instead of the drawn samples")
    parser.add_argument("--off", type=float, default=0.0, help="with --plain: also its variant with the chunk decay's "
                        "gradient (the dot) this far off, e.g. 0.01")
    parser.add_argument("--cpp", action="store_true", help="also the built C++ op (on --device: the CUDA kernels)")
    parser.add_argument("--flashqla", action="store_true", help="also FlashQLA's formulation (flashqla_chunked: every "
                        "product bf16, Ar stored and the state read in bf16; and with Q K^T exact)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # name: the implementation of an op (the variant's split of each site, the states it stores in bf16)
    variants = {name: lambda op, name=name: candidate(op, lambda site: name) for name in ("float32", "tf32x3",
                                                                                          "bf16x3", "bf16")}
    plain = [site for site in args.plain.split(",") if site]
    stored = tuple(x for x in args.stored.split(",") if x)
    for site in plain:
        if site not in PRODUCT_SITES:
            parser.error(f"--plain: unknown site {site!r}; the sites are {', '.join(PRODUCT_SITES)}")
    for x in stored:
        if x not in STORED:
            parser.error(f"--stored: unknown state {x!r}; the states are {', '.join(STORED)}")
    if (stored or args.off) and not plain:
        parser.error("--stored, --off: give the sites in plain bf16 with --plain (the kernels' own)")
    for sites in [[site] for site in PRODUCT_SITES] if args.each else []:
        variants[f"bf16 at {'+'.join(sites)}"] = lambda op, sites=sites: candidate(
            op, lambda site: "bf16" if site in sites else "bf16x3")
    # The kernels' own rounding (the --plain sites, the --stored states), the others bf16x3: the
    # variant each row's g gradient is measured from.
    kernels = None
    if plain:
        of_site = lambda site: "bf16" if site in plain else "bf16x3"  # noqa: E731
        kernels = f"bf16 at {'+'.join(plain)}"
        variants[kernels] = lambda op: candidate(op, of_site)
        if stored:
            kernels += f", {' and '.join(stored)} stored in bf16"
            variants[kernels] = lambda op: candidate(op, of_site, stored)
        if args.off:
            variants[f"the same, the dot {args.off:g} off"] = lambda op: candidate(op, of_site, stored, args.off)
    if args.cpp:
        variants[f"the C++ op ({args.device})"] = lambda op: resolve(op)[op]
    if args.flashqla:
        for exact_qk in (False, True):
            ops_ = FlashQlaOps(exact_qk)
            name = "FlashQLA's formulation, bf16 products" + (" but Q K^T exact" if exact_qk else "")
            variants[name] = lambda op, ops_=ops_: (ops_.v4_gated_delta_rule if op == "v4_gated_delta_rule"
                                                    else functools.partial(v4_gated_deltanet, ops=ops_))
    grad_of_g = {"v4_gated_delta_rule": "g", "v4_gated_deltanet": "linear_attn.A_log"}
    print("| op | products | samples failed | tensors that failed first | A_log's error / the reference's (median, "
          "max; the largest over the judge's first exit's bound) | "
          f"g's gradient from {kernels or '-'}: distance / norm (median, max) |")
    print("|---|---|---|---|---|---|")
    for op in ["v4_gated_delta_rule"] if args.long else args.ops.split(","):
        case, reference = CASES[op], REFERENCE[op]
        failed = {v: [] for v in variants}  # (sample, its first failing tensor)
        ratios = {v: [] for v in variants}
        margins = {v: [] for v in variants}  # A_log's error over the judge's first exit's bound
        apart = {v: [] for v in variants}
        for i in range(args.samples):
            if args.long:
                sample = long_documents(torch.bfloat16, args.device, i)
            else:
                sample = case.samples(RandomDraw(i), torch.bfloat16, args.device)
            seed = random.Random(10**6 + i).randrange(2**31)
            upstream = upstream_of(seed)
            ref_out, ref = forward_backward(reference, sample, upstream, seed)
            true_out, truth = forward_backward(reference, in_float64(sample), upstream, seed)
            spreads = Spreads(reference, sample, upstream, seed)
            runs = {v: forward_backward(implementation(op), sample, upstream, seed)
                    for v, implementation in variants.items()}
            for v, (outputs, grads) in runs.items():
                try:  # as check_parity judges: every output and gradient, the first failure raised
                    _compare(case, sample, outputs, grads, ref_out, ref, true_out, truth, spreads)
                except AssertionError as failure:
                    failed[v].append((i, str(failure).removeprefix(f"{op} ").split(" [")[0]))
                a_log = "linear_attn.A_log"
                if a_log in grads and (ref[a_log] - truth[a_log]).norm() > 0:
                    err = lambda x: (x.double() - truth[a_log].double()).norm().item()  # noqa: E731
                    ratios[v].append(err(grads[a_log]) / err(ref[a_log]))
                    bound = low_precision_bound(ref[a_log].double(), truth[a_log].double(), torch.bfloat16)
                    margins[v].append(err(grads[a_log]) / bound)
                if kernels:
                    apart[v].append(distance(grads[grad_of_g[op]], runs[kernels][1][grad_of_g[op]]))
        for v in variants:
            r, d = sorted(ratios[v]), sorted(apart[v])
            stats = f"{r[len(r) // 2]:.2f}, {r[-1]:.2f} (of the bound: {max(margins[v]):.2f})" if r else "-"
            dist = f"{d[len(d) // 2]:.2e}, {d[-1]:.2e}" if d else "-"
            print(f"| {op} | {v} | {len({i for i, _ in failed[v]})} of {args.samples} | "
                  f"{', '.join(sorted({t for _, t in failed[v]})) or '-'} | {stats} | {dist} |", flush=True)


if __name__ == "__main__":
    main()
