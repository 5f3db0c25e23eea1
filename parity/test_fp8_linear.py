"""The FP8 linear map's path (a) on CUDA (issue 16): a bf16 activation quantised per row per 128
columns to e4m3 times an FP8 weight on tensor cores. It is not exact against dequantise-then-
linear, so it is held to the elementwise bound of parity/fp8_bound.py against the float64 truth
x W^T (W the exact FP8 value times its scale), derived from the activation's rounding and never
from what the kernel gives. The bound must also catch wrong implementations: emulations with a
scale dropped, the activation scales laid out transposed, or the activation quantised with its
blocks down the columns fail it (on any device: no kernel needed).

And the routed experts' FP8 kernel on CUDA (cc/common/fp8_grouped.cu), both ways: a bf16 product
of the weight dequantised as the loader does, held element by element to that product's bound
(fp8_bound.bf16_matmul), which emulations of wrong kernels fail; and its products on FP8 tensor
cores (V4TRAIN_FP8_TENSOR_CORES=experts; a dense map's dy W with dense_backward), x quantised as
path (a)'s, held to path (a)'s bound, which emulations of that kernel's wrong variants fail."""

import re

import pytest
import torch

import v4_linear_test
from parity.fp8_bound import BLOCK, Bounded, assert_within, bf16_matmul, blocks_of_sizes, fp8_linear
from v4train.reference.lora import FP8_MAX, Linear, dequantize_fp8, quantize_fp8

# ("cuda" in the names: the CPU suite on a GPU machine deselects them with -k "not cuda", as parity does.)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")


@pytest.fixture(autouse=True)
def tensor_cores(monkeypatch):
    """Path (a) is opt-in (lora.h's fp8_tensor_cores): the dense forward, unless a test asks for others."""
    monkeypatch.setenv("V4TRAIN_FP8_TENSOR_CORES", "dense_forward")

# (M, K, N): one row; K/128 = 1, 3 and 10 (not multiples of 4: the weight scales are padded for
# cuBLAS), 16 and 48; up to GLM-5's width.
SHAPES = [(1, 128, 128), (1, 6144, 1536), (37, 384, 256), (37, 1280, 6144), (4096, 2048, 512), (4096, 6144, 6144)]


def activations(m: int, k: int, gen: torch.Generator, signed: bool) -> torch.Tensor:
    """bf16 [m, k] with the spread that makes the block scales matter: rows and 128-column blocks (the
    last one partial where k is no multiple of 128) 2^-6..2^6 apart (tokens and channels of different
    sizes), outliers 50x, so that most of a block with an outlier lands in e4m3's subnormals.
    Nonnegative values leave the bound nothing to cancel: there it is tight enough to catch a wrong
    scale of a few percent."""
    x = torch.randn(m, k, generator=gen)
    x *= 2.0 ** torch.randint(-6, 7, (m, 1), generator=gen)
    x *= (2.0 ** torch.randint(-6, 7, (1, -(-k // BLOCK)), generator=gen)).repeat_interleave(BLOCK, -1)[:, :k]
    outliers = torch.rand(m, k, generator=gen) < 0.002
    x = torch.where(outliers, x * 50, x)
    return (x if signed else x.abs()).to(torch.bfloat16)


def quantised_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8.cuh quantize_rows by its definition, on the CPU: per row per 128 columns s = amax / 448 (1
    for a zero block, at least float32's smallest normal), q = x / s rounded to the nearest e4m3,
    saturating; the rows padded to 16 with zeros of scale 1; q [padded, k], s [k / 128, padded]."""
    m, k = x.shape
    padded = -(-m // 16) * 16
    blocks = torch.zeros(padded, k, dtype=torch.float32)
    blocks[:m] = x.float().cpu()
    blocks = blocks.view(padded, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1)
    s = torch.where(amax > 0, (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny), torch.ones_like(amax))
    q = (blocks / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(padded, k), s.t().contiguous()


@CUDA
@pytest.mark.parametrize("m,k", [(1, 256), (37, 384), (37, 1280), (4096, 6144), (300, 2048), (4096, 7168),
                                 (2048, 3200)])
def test_the_activations_quantisation_on_cuda_is_its_definition_bit_for_bit(m, k):
    """fp8.cu's quantize_rows (a half-warp a 128-column block, two blocks a warp: k / 128 odd leaves a
    half idle) against quantised_rows: every byte of q and every scale equal. Among the blocks, zero
    ones (scale 1) and ones whose largest value is a bf16 subnormal (the scale's floor); x also as a
    view that starts 8 bytes off 16 (re-copied before the kernel's 16-byte loads). The last two
    shapes cap the grid (8,448 warps) at a stride that is no multiple of a row's pairs of blocks (28,
    13): each warp's (row, pair) steps across rows with a carry."""
    gen = torch.Generator().manual_seed(m + k)
    x = activations(m, k, gen, signed=True)
    x[0, :BLOCK] = 0.0
    x[-1, -BLOCK:] = torch.randn(BLOCK, generator=gen).to(torch.bfloat16) * 1e-39
    flat = torch.empty(m * k + 4, dtype=torch.bfloat16, device="cuda")
    for cuda_x in (x.cuda(), flat[4:].view(m, k).copy_(x)):
        q, scale = v4_linear_test.quantize_rows(cuda_x)
        want_q, want_scale = quantised_rows(x)
        assert q.dtype == torch.float8_e4m3fn and q.shape == want_q.shape and scale.shape == want_scale.shape
        assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8)), "q"
        assert torch.equal(scale.cpu(), want_scale), f"scale: max difference {(scale.cpu() - want_scale).abs().max()}"


@CUDA
def test_the_dequantisation_on_cuda_equals_the_references_where_its_threads_step(monkeypatch):
    """fp8.cu's dequantize_kernel on weights of more than its grid's 540,672 vectors of 16, so that
    each thread's (matrix, row, vector) steps with carries: [576, 16384] and [576, 16400] maps (rows
    of a partial block; 16,400 columns end in a partial column block) through the dense product, and
    [6, 576, 7168] experts through the grouped one (which its FP8 kernel declines: 576 rows are no
    whole blocks), where a step carries a row in 86% of steps and a matrix in 7% (emulated). The
    products on the reference's dequantisation are the same GEMMs, so every value equal means every
    weight equal."""
    monkeypatch.setenv("V4TRAIN_FP8_TENSOR_CORES", "none")
    gen = torch.Generator().manual_seed(7)
    for cols in (16384, 16400):
        q, scale = quantize_fp8(torch.randn(576, cols, generator=gen) * 0.05)
        x = activations(8, cols, gen, signed=True).cuda()
        y = v4_linear_test.linear(x, Linear(q.cuda(), scale.cuda()))
        want = v4_linear_test.linear(x, Linear(dequantize_fp8(q, scale, torch.bfloat16).cuda()))
        assert torch.equal(y, want), f"dense, {cols} columns: max difference {(y - want).abs().max().item()}"
    q, scale = quantize_fp8(torch.randn(6, 576, 7168, generator=gen) * 0.05)
    counts = torch.tensor([5, 0, 9, 1, 0, 3])
    x = activations(18, 7168, gen, signed=True).cuda()
    y = v4_linear_test.grouped(x, Linear(q.cuda(), scale.cuda()), counts.cuda())
    want = v4_linear_test.grouped(x, Linear(dequantize_fp8(q, scale, torch.bfloat16).cuda()), counts.cuda())
    assert torch.equal(y, want), f"grouped: max difference {(y - want).abs().max().item()}"


@CUDA
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "nonnegative"])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_the_fp8_path_on_cuda_is_within_its_bound_of_the_truth(m, k, n, signed):
    gen = torch.Generator().manual_seed(m * 7 + k * 3 + n + signed)
    q, scale = blocks_of_sizes((n, k), gen)
    x = activations(m, k, gen, signed).cuda()
    q, scale = q.cuda(), scale.cuda()
    y = v4_linear_test.linear(x, Linear(q, scale))
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    # Path (a) ran, not the dequantised product (which rounds the weight to bf16 instead of x to e4m3).
    assert not torch.equal(y, torch.nn.functional.linear(x, dequantize_fp8(q, scale, torch.bfloat16)))
    ratio = assert_within(y, fp8_linear(Bounded.exact(x), q, scale), "y")
    print(f"fp8 path (a) {m}x{k}x{n} {'signed' if signed else 'nonnegative'}: max |y - truth| / bound = {ratio:.3f}")


@CUDA
def test_the_fp8_path_on_cuda_keeps_the_leading_dimensions_and_its_adapter():
    """x [2, 5, K] (a view, not contiguous in its rows) with a LoRA adapter: the adapter's term on
    top of path (a), within the same bound plus the adapter's bf16 rounding."""
    gen = torch.Generator().manual_seed(3)
    q, scale = blocks_of_sizes((256, 384), gen)
    base = activations(10, 768, gen, True).cuda()
    x = base[:, :384].reshape(2, 5, 384)  # rows 768 apart
    a = (torch.randn(4, 384, generator=gen) * 0.05).to(torch.bfloat16).cuda()
    b = (torch.randn(256, 4, generator=gen) * 0.05).to(torch.bfloat16).cuda()
    y = v4_linear_test.linear(x, Linear(q.cuda(), scale.cuda(), a, b), lora_scaling=2.0)
    assert y.shape == (2, 5, 256)
    plain = v4_linear_test.linear(x, Linear(q.cuda(), scale.cuda()))
    adapter = torch.nn.functional.linear(torch.nn.functional.linear(x, a), b) * 2.0
    bound = fp8_linear(Bounded.exact(x.reshape(10, 384)), q.cuda(), scale.cuda())
    assert_within(plain.reshape(10, 256), bound, "y without its adapter")
    # y = bf16(plain + adapter): exactly the sum of the two bf16 tensors, rounded once.
    assert torch.equal(y, plain + adapter)


def _emulated(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, mutation: str) -> torch.Tensor:
    """Path (a) computed in float64 (no kernel), right or with one bug, rounded to bf16."""
    m, k = x.shape
    blocks = x.double().view(m, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1)
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # [m, K/128]
    if mutation == "blocks_down_the_columns":  # scales of 128 x 1 blocks, the GEMM reading 1 x 128 ones
        col = x.double().abs().view(m // BLOCK, BLOCK, k).amax(1)
        col_s = torch.where(col > 0, col / FP8_MAX, torch.ones_like(col)).repeat_interleave(BLOCK, 0)
        xq = (x.double() / col_s).float().to(torch.float8_e4m3fn).double().view(m, k // BLOCK, BLOCK)
    else:
        xq = (blocks / s[..., None]).float().to(torch.float8_e4m3fn).double()
    if mutation == "activation_scale_dropped":
        x_hat = xq
    elif mutation == "activation_scales_transposed":  # written [m, K/128] row-major, read column-major
        x_hat = xq * s.reshape(-1).view(k // BLOCK, m).t()[..., None]
    elif mutation == "activation_scale_25_percent_high":
        x_hat = xq * s[..., None] * 1.25
    else:
        x_hat = xq * s[..., None]
    w = q.double() if mutation == "weight_scale_dropped" else dequantize_fp8(q, scale, torch.float64)
    return (x_hat.view(m, k) @ w.T).to(torch.bfloat16)


MUTATIONS = ["activation_scale_dropped", "weight_scale_dropped", "activation_scales_transposed",
             "blocks_down_the_columns", "activation_scale_25_percent_high"]


@pytest.mark.parametrize("mutation", MUTATIONS)
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "nonnegative"])
def test_the_bound_fails_a_wrong_fp8_path(mutation, signed):
    """Every mutation breaks the bound, where the right emulation keeps it (at 0.2-0.3 of it): the
    bound is not so loose that a wrong scale passes. It allows about 8% of sum |x||W| per element
    (2^-4 for e4m3, 1.6% for the tensor cores' accumulation), so a scale 25% high fails it; one 5%
    high passes (0.5-0.7 of the bound; 10% high: 0.9-1.1). A transposed scale layout or blocks down
    the columns change nothing where rows or blocks are alike: the data's spread of rows and blocks
    is what real activations have."""
    gen = torch.Generator().manual_seed(11)
    m, k, n = 256, 512, 256
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, scale = (t.to(device) for t in blocks_of_sizes((n, k), gen))
    x = activations(m, k, gen, signed).to(device)
    bound = fp8_linear(Bounded.exact(x), q, scale)
    assert_within(_emulated(x, q, scale, "none"), bound, "the right emulation")
    with pytest.raises(AssertionError, match="outside its bound"):
        assert_within(_emulated(x, q, scale, mutation), bound, mutation)


# The experts' kernel: rows of 5 experts (tiles partial, none, one row, several tiles of each
# shape), weights [5, 640, 384] (outputs of 640 and, backward, 384 columns: two and a half and one
# and a half of the wide tile's 256, so each way ends on a tile whose second scale block is past N).
COUNTS, OUT, IN = [3000, 0, 1, 129, 9000], 640, 384


def _experts_run(seed: int, counts: list[int] = COUNTS, out: int = OUT, inp: int = IN, signed: bool = True):
    """FP8 experts' weights [E, out, in] of blocks of different sizes, x and dy of those rows; y and x's
    gradient through v4::fp8_product with a dispatch (the test-only module's `grouped`) on CUDA, with
    the profile of both: (q, scale, x, dy, y, dx, prof)."""
    gen = torch.Generator().manual_seed(seed)
    q, scale = blocks_of_sizes((len(counts), out, inp), gen)
    x = activations(sum(counts), inp, gen, signed).cuda().requires_grad_()
    dy = activations(sum(counts), out, gen, signed).cuda()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        y = v4_linear_test.grouped(x, Linear(q.cuda(), scale.cuda()), torch.tensor(counts).cuda())
        (dx,) = torch.autograd.grad(y, x, dy)
        torch.cuda.synchronize()
    return q, scale, x, dy, y, dx, prof


def _grouped_bound(x: torch.Tensor, w: torch.Tensor) -> Bounded:
    """Each expert's rows of x times w[e] (float64, exact) as a bf16 product: fp8_bound.bf16_matmul."""
    parts = [bf16_matmul(Bounded.exact(xe), we) for xe, we in zip(x.double().cpu().split(COUNTS), w)]
    return Bounded(torch.cat([b.value for b in parts]), torch.cat([b.err for b in parts]))


def _grouped_emulated(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, mutation: str) -> torch.Tensor:
    """The kernel's arithmetic, forward (x W_e^T), on any device: the weight dequantised to bf16 as the
    loader does, fp32 sums, the result rounded to bf16; or one of a wrong kernel's mistakes."""
    x = x.clone()
    if mutation == "one_scale_a_tile":  # output columns 128-255 of each 256 scaled by 0-127's block
        scale = scale.clone()
        scale[:, 1::2] = scale[:, 0 : scale.shape[1] - 1 : 2]
    ends = torch.tensor(COUNTS).cumsum(0)
    if mutation == "last_row_dropped":
        x[[int(end) - 1 for end, n in zip(ends, COUNTS) if n > 0]] = 0
    if mutation == "last_step_dropped":
        x[:, -64:] = 0
    w = dequantize_fp8(q, scale, torch.bfloat16).float()
    return torch.cat([xe.float() @ we.T for xe, we in zip(x.split(COUNTS), w)]).to(torch.bfloat16)


@pytest.mark.parametrize("mutation", ["one_scale_a_tile", "last_row_dropped", "last_step_dropped"])
def test_the_bf16_product_bound_fails_a_wrong_experts_kernel(mutation):
    """The right emulation of the experts' kernel keeps the bound; each wrong one breaks it (its
    CUDA mutations, tools/mutants.py, make the same mistakes in the kernel)."""
    gen = torch.Generator().manual_seed(13)
    q, scale = blocks_of_sizes((len(COUNTS), OUT, IN), gen)
    x = activations(sum(COUNTS), IN, gen, signed=True)
    bound = _grouped_bound(x, dequantize_fp8(q, scale, torch.float64).transpose(1, 2))
    assert_within(_grouped_emulated(x, q, scale, "none"), bound, "the right emulation")
    with pytest.raises(AssertionError, match="outside its bound"):
        assert_within(_grouped_emulated(x, q, scale, mutation), bound, mutation)


@CUDA
@pytest.mark.parametrize("tile", ["128x256", "256x128", None], ids=["128x256", "256x128", "chosen"])
def test_the_experts_fp8_kernel_on_cuda_is_within_a_bf16_products_bound(tile, monkeypatch):
    """cc/common/fp8_grouped.cu through v4::fp8_product with a dispatch, as the routed experts call
    it: y = x W_e^T for each expert's rows and, through autograd, x's gradient dy W_e. Both are bf16
    products of the weight dequantised as the loader does (fp32 sums, one rounding of the result),
    so each element must lie within such a product's bound of the float64 truth. More tiles than
    multiprocessors, so that each persistent block takes several. The profile shows the kernels ran
    both ways with the tile asked for (a kernel that declined would leave the dequantised path to
    pass alone): fp8_registers_kernel both ways, its tokens a tile the tile's rows. Unasked, the kernel
    takes 256 x 128 where the experts average 256 rows or more (here 2,426)."""
    monkeypatch.setenv("V4TRAIN_FP8_TENSOR_CORES", "none")
    monkeypatch.delenv("V4TRAIN_FP8_GROUPED_VARIANTS", raising=False)
    if tile is None:
        monkeypatch.delenv("V4TRAIN_FP8_GROUPED_TILE", raising=False)
        tile = "256x128"
    else:
        monkeypatch.setenv("V4TRAIN_FP8_GROUPED_TILE", tile)
    q, scale, x, dy, y, dx, prof = _experts_run(17)
    rows, cols = (int(n) for n in tile.split("x"))
    assert _grouped_kinds(prof) == sorted([f"registers_kernel<false,{rows}", f"registers_kernel<true,{rows}"])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert sum(-(-n // rows) for n in COUNTS) * -(-IN // cols) > sms  # the launch of the fewest tiles
    w = dequantize_fp8(q, scale, torch.float64)
    ratios = (assert_within(y.cpu(), _grouped_bound(x.detach(), w.transpose(1, 2)), "y"),  # (bounds on the CPU)
              assert_within(dx.cpu(), _grouped_bound(dy, w), "x's gradient"))
    print(f"experts' FP8 kernel, tile {tile}: max |error| / bound = {ratios[0]:.3f} (y), {ratios[1]:.3f} (dx)")


def _variant_runs(monkeypatch, tile, cols, seed, kernels, **shape):
    """(y, dx) of _experts_run under each V4TRAIN_FP8_GROUPED_VARIANTS value of `kernels` (value -> the
    kernels its profile must show), on exact products of one tile, with more tiles of `cols` columns
    than multiprocessors (each persistent block takes several); and the run's q, scale, x, dy."""
    monkeypatch.setenv("V4TRAIN_FP8_TENSOR_CORES", "none")
    monkeypatch.setenv("V4TRAIN_FP8_GROUPED_TILE", tile)
    rows = int(tile.split("x")[0])
    assert sum(-(-n // rows) for n in COUNTS) * (cols // 128) > torch.cuda.get_device_properties(0).multi_processor_count
    runs = {}
    for variants, want in kernels.items():
        monkeypatch.setenv("V4TRAIN_FP8_GROUPED_VARIANTS", variants)
        q, scale, x, dy, y, dx, prof = _experts_run(seed, **shape)
        assert _grouped_kinds(prof) == sorted(want), variants
        runs[variants] = y, dx
    return runs, (q, scale, x, dy)


@CUDA
@pytest.mark.parametrize("tile", ["128x256", "256x128"])
@pytest.mark.parametrize("shape", [{}, {"inp": 128}, {"out": 128}], ids=["640x384", "640x128", "128x384"])
def test_the_experts_fp8_registers_kernel_on_cuda_is_within_the_bound_and_equals_staged(tile, shape, monkeypatch):
    """Both ways on fp8_registers_kernel, unasked: the forward y = x W_e^T (y^T's tiles, 128 features by
    the tile's rows of tokens: 128 for 128x256, 256 for 256x128; the weight turned from FP8 by the
    multiplying warps into wgmma's A registers, x's tile the B operand) and x's gradient dx = dy W_e
    (dx^T = W_e^T dy^T: the weight's tile as it lies, turned into A's registers by ldmatrix .trans and a
    byte permute, its rows the features in a permuted order the epilogue undoes), against
    V4TRAIN_FP8_GROUPED_VARIANTS=staged (fp8_grouped_kernel both ways, the weight dequantised into shared
    memory). The unasked y and dx within a bf16 product's bound of the float64 truth, expert by expert
    (COUNTS: partial, empty and one-row experts; the wider way more tiles than multiprocessors, so that
    each persistent block takes several), then equal to staged's bit for bit: the same bf16 operands and
    fp32 sums of the same 16-wide slices in the same order, A and B swapped (a failure there with the
    bound kept says the tensor core sums a product's 16 terms in an order that depends on which operand
    is A). At 128 inputs
    the forward's tile is two steps, at 128 outputs the backward's. The profile shows which kernel ran
    each way."""
    rows = int(tile.split("x")[0])
    runs, (q, scale, x, dy) = _variant_runs(monkeypatch, tile, max(shape.get("out", OUT), shape.get("inp", IN)), 47, {
        "none": [f"registers_kernel<false,{rows}", f"registers_kernel<true,{rows}"],
        "staged": ["grouped_kernel<false", "grouped_kernel<true"]}, **shape)
    w = dequantize_fp8(q, scale, torch.float64)
    ratios = (assert_within(runs["none"][0].cpu(), _grouped_bound(x.detach(), w.transpose(1, 2)), "y"),
              assert_within(runs["none"][1].cpu(), _grouped_bound(dy, w), "x's gradient"))
    print(f"registers kernel, tile {tile}, {shape}: max |error| / bound = {ratios[0]:.3f} (y), {ratios[1]:.3f} (dx)")
    _assert_same_bits(runs["none"], runs["staged"])


def _grouped_kinds(prof) -> list[str]:
    """The exact kernels' launches, sorted, spaces dropped: grouped_kernel<true|false (backward?) or
    registers_kernel<true|false,BT."""
    names = [re.sub(r"\s", "", e.name) for e in prof.events() if re.search(r"fp8_(grouped|registers)_kernel<", e.name)]
    return sorted(re.search(r"fp8_(grouped_kernel<(?:true|false)|registers_kernel<(?:true|false),\d+)", n).group(1)
                  for n in names)


def _assert_same_bits(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    """A variant's (y, x's gradient) equal the kernel's unasked bit for bit."""
    for name, g, w in zip(("y", "x's gradient"), got, want):
        assert torch.equal(g, w), f"{name}: max difference {(g - w).abs().max().item()}"


def _path_a_grouped_bound(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, counts: list[int],
                          transposed: bool = False) -> Bounded:
    """Each expert's rows of x through path (a) (fp8_bound.fp8_linear) with its weight: x W_e^T, or
    x W_e where `transposed` (the weight's transpose, its scales with it)."""
    parts = []
    for xe, qe, se in zip(x.detach().cpu().split(counts), q.cpu(), scale.cpu()):
        if transposed:
            qe, se = qe.t().contiguous(), se.t().contiguous()
        parts.append(fp8_linear(Bounded.exact(xe), qe, se))
    return Bounded(torch.cat([b.value for b in parts]), torch.cat([b.err for b in parts]))


def _e4m3_emulated(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, counts: list[int], transposed: bool,
                   mutation: str) -> torch.Tensor:
    """The experts' kernel on FP8 tensor cores in float64 (no kernel): each expert's rows quantised per
    row per 128 columns, each 128-column block's exact sum times the row's and the weight block's
    scales, summed, rounded to bf16; or with one of a wrong kernel's mistakes (its CUDA mutations,
    tools/mutants.py's fp8_e4m3_*)."""
    outs = []
    for xe, qe, se in zip(x.double().split(counts), q, scale):
        qw, sw = qe.double(), se.double()  # [out, in], [out / 128, in / 128]
        if transposed:
            qw, sw = qw.t(), sw.t()  # [N, K] as the products read them
        m, k = xe.shape
        n, blocks = qw.shape[0], k // BLOCK
        amax = xe.view(m, blocks, BLOCK).abs().amax(-1)
        sx = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # [m, blocks]
        xq = (xe.view(m, blocks, BLOCK) / sx[..., None]).float().to(torch.float8_e4m3fn).double()
        if mutation == "row_scale_upper_half":  # the fragment's rows 8-15 of each 16 take rows 0-7's scales
            upper = torch.arange(m) % 16 >= 8
            sx = sx.clone()
            sx[upper] = sx[torch.arange(m)[upper] - 8]
        if mutation == "transpose_unswizzled" and transposed:  # the tile's row n read with its chunks ^ n % 8
            col = torch.arange(k)
            chunk = (col % BLOCK // 16)[None, :] ^ (torch.arange(n) % 8)[:, None]
            qw = qw.gather(1, (col // BLOCK * BLOCK + chunk * 16 + col % 16).expand(n, k))
        sums = torch.stack([xq[:, b] @ qw[:, b * BLOCK:(b + 1) * BLOCK].t() for b in range(blocks)])  # [blocks, m, n]
        if mutation == "sums_unpromoted":  # the tensor cores' sums carried from block to block
            sums = sums.cumsum(0)
        w_block = sw[:, :1].expand(-1, blocks) if mutation == "weight_scale_first_block" else sw  # [n / 128, blocks]
        w_scale = w_block.repeat_interleave(BLOCK, 0).t()  # [blocks, n]
        outs.append((sums * sx.t()[:, :, None] * w_scale[:, None, :]).sum(0))
    return torch.cat(outs).to(torch.bfloat16)


E4M3_MUTATIONS = [("weight_scale_first_block", False), ("row_scale_upper_half", False), ("sums_unpromoted", False),
                  ("transpose_unswizzled", True)]


@pytest.mark.parametrize("mutation,transposed", E4M3_MUTATIONS, ids=[m for m, _ in E4M3_MUTATIONS])
def test_path_a_bound_fails_a_wrong_experts_fp8_tensor_core_kernel(mutation, transposed):
    """The right emulation keeps path (a)'s bound both ways; each wrong one breaks it."""
    gen = torch.Generator().manual_seed(19)
    counts = [300, 0, 1, 129, 200]
    q, scale = blocks_of_sizes((len(counts), OUT, IN), gen)
    x = activations(sum(counts), OUT if transposed else IN, gen, signed=True)
    bound = _path_a_grouped_bound(x, q, scale, counts, transposed)
    assert_within(_e4m3_emulated(x, q, scale, counts, transposed, "none"), bound, "the right emulation")
    with pytest.raises(AssertionError, match="outside its bound"):
        assert_within(_e4m3_emulated(x, q, scale, counts, transposed, mutation), bound, mutation)


def _kernel_launches(prof, name: str) -> list[str]:
    """Which ways `name` ran (its template's first argument: true backward), sorted."""
    return sorted(re.search(rf"{name}<(true|false)", e.name).group(1) for e in prof.events() if f"{name}<" in e.name)


@CUDA
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "nonnegative"])
@pytest.mark.parametrize("counts,out,inp", [(COUNTS, OUT, IN), ([1000, 3100], 2048, 256)],
                         ids=["5 experts 640x384", "2 experts 2048x256"])
def test_the_experts_kernel_on_cuda_fp8_tensor_cores_is_within_path_a_bound(counts, out, inp, signed, monkeypatch):
    """V4TRAIN_FP8_TENSOR_CORES=experts: x (and, backward, dy) quantised per row per 128 columns and
    the products on FP8 tensor cores, each 128-column block promoted with its scales: y and x's
    gradient within path (a)'s bound of the float64 truth, expert by expert. The profile shows the
    kernel ran both ways; more tiles than multiprocessors (each persistent block takes several). The
    kernels without their variants (the defaults, which the next test holds to these bit for bit)."""
    monkeypatch.setenv("V4TRAIN_FP8_TENSOR_CORES", "experts")
    monkeypatch.setenv("V4TRAIN_FP8_E4M3_VARIANTS", "none")
    q, scale, x, dy, y, dx, prof = _experts_run(23 + out + signed, counts, out, inp, signed)
    assert _kernel_launches(prof, "fp8_e4m3_kernel") == ["false", "true"]
    assert y.shape == (sum(counts), out) and dx.shape == x.shape
    ratios = (assert_within(y.cpu(), _path_a_grouped_bound(x, q, scale, counts), "y"),
              assert_within(dx.cpu(), _path_a_grouped_bound(dy, q, scale, counts, transposed=True), "x's gradient"))
    print(f"experts' FP8 kernel on FP8 tensor cores, {len(counts)} experts {out}x{inp}: max |error| / bound = "
          f"{ratios[0]:.3f} (y), {ratios[1]:.3f} (dx)")


# 160 experts of 0-40 rows: transpose_global's groups of 40 span two rounds of the tile search's 32 lanes.
MANY = [(7 * e) % 41 if e % 9 else 0 for e in range(160)]


@CUDA
@pytest.mark.parametrize("variants,counts,out,inp", [
    ("transpose_global", COUNTS, OUT, IN), ("wide", COUNTS, OUT, IN), ("transpose_global,wide", COUNTS, OUT, IN),
    ("transpose_global", MANY, 256, 128), ("wide", COUNTS, 1152, IN), ("wide", COUNTS, 1152, 128)],
    ids=["turned", "wide", "both", "turned 160 experts", "wide, 5 column tiles", "wide, one step a tile"])
def test_the_e4m3_kernels_variants_equal_it_on_cuda_fp8_tensor_cores(variants, counts, out, inp, monkeypatch):
    """V4TRAIN_FP8_E4M3_VARIANTS: `transpose_global` (the backward's weight transposed in global memory
    by transpose_fp8_kernel a group of experts at a time: of 5 experts 2, 2 and 1, one with no row; of
    160, four groups of 40; then the forward's kernel on each group) and `wide` (the forward's tiles
    128 x 256; at 640 columns each row tile's last is half wide) sum the same products in the same
    order as the kernel unasked: y and x's gradient equal its bit for bit, within path (a)'s bound;
    the profile shows which kernels ran, and how often. At 1,152 columns (5 column tiles, which do
    not divide 132 multiprocessors) a block's consecutive tiles differ in their halves, whose first
    scales load during the tile before; at 128 inputs each tile is one step."""
    monkeypatch.setenv("V4TRAIN_FP8_TENSOR_CORES", "experts")
    monkeypatch.setenv("V4TRAIN_FP8_E4M3_VARIANTS", "none")
    _, _, _, _, y0, dx0, _ = _experts_run(41, counts, out, inp)
    monkeypatch.setenv("V4TRAIN_FP8_E4M3_VARIANTS", variants)
    q, scale, x, dy, y, dx, prof = _experts_run(41, counts, out, inp)
    turned, wide = "transpose_global" in variants, "wide" in variants
    group = max(1, min(-(-len(counts) // 4), (256 << 20) // (out * inp)))  # launch_e4m3's groups
    groups = -(-len(counts) // group) if turned else 0
    assert _kernel_launches(prof, "fp8_e4m3_kernel") == (["false"] * (1 + groups) if turned else ["false", "true"])
    assert sum("transpose_fp8_kernel" in e.name for e in prof.events()) == groups  # (a launch an event)
    assert any(re.search(r"fp8_e4m3_kernel<false,\s*256>", e.name) for e in prof.events()) == wide
    assert_within(y.cpu(), _path_a_grouped_bound(x, q, scale, counts), "y")
    assert_within(dx.cpu(), _path_a_grouped_bound(dy, q, scale, counts, transposed=True), "x's gradient")
    _assert_same_bits((y, dx), (y0, dx0))


@CUDA
@pytest.mark.parametrize("variable, tensor_cores, value, word", [
    ("V4TRAIN_FP8_E4M3_VARIANTS", "experts", "wide,turned", "turned"),
    ("V4TRAIN_FP8_GROUPED_VARIANTS", "none", "registers", "registers")])  # (the forward's, retired: the default)
def test_an_unknown_kernel_variant_is_refused_on_cuda(variable, tensor_cores, value, word, monkeypatch):
    """A misspelt variant of the e4m3 kernel or of the exact one is an error naming the variable and the word."""
    monkeypatch.setenv("V4TRAIN_FP8_TENSOR_CORES", tensor_cores)
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=rf"{variable}={value}: unknown variant '{word}'"):
        _experts_run(41)


@CUDA
def test_the_experts_forward_alone_on_cuda_fp8_tensor_cores(monkeypatch):
    """V4TRAIN_FP8_TENSOR_CORES=experts_forward: y on FP8 tensor cores within path (a)'s bound, x's
    gradient on the bf16 kernel within a bf16 product's bound; the profile shows each kernel ran its way."""
    monkeypatch.setenv("V4TRAIN_FP8_TENSOR_CORES", "experts_forward")
    q, scale, x, dy, y, dx, prof = _experts_run(37)
    assert _kernel_launches(prof, "fp8_e4m3_kernel") == ["false"]
    assert _kernel_launches(prof, "fp8_registers_kernel") == ["true"]
    assert_within(y.cpu(), _path_a_grouped_bound(x, q, scale, COUNTS), "y")
    assert_within(dx.cpu(), _grouped_bound(dy, dequantize_fp8(q, scale, torch.float64)), "x's gradient")


@CUDA
@pytest.mark.parametrize("variants", ["none", ""], ids=["transposed in shared memory", "turned once (default)"])
def test_a_dense_backward_on_cuda_fp8_tensor_cores_is_within_its_bound(variants, monkeypatch):
    """V4TRAIN_FP8_TENSOR_CORES=dense_backward: a dense FP8 map's dy W on the experts' kernel (W the
    one expert), within path (a)'s bound; the forward stays the dequantised product, bit for bit.
    x with leading dimensions [3, 700, K]. By the kernel that transposes W's tiles, or (the e4m3
    variants' default, transpose_global) W turned once, then the forward's kernel."""
    monkeypatch.setenv("V4TRAIN_FP8_TENSOR_CORES", "dense_backward")
    monkeypatch.setenv("V4TRAIN_FP8_E4M3_VARIANTS", variants)
    gen = torch.Generator().manual_seed(29)
    q, scale = blocks_of_sizes((640, 384), gen)
    x = activations(2100, 384, gen, signed=True).cuda().view(3, 700, 384).requires_grad_()
    dy = activations(2100, 640, gen, signed=True).cuda()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        y = v4_linear_test.linear(x, Linear(q.cuda(), scale.cuda()))
        (dx,) = torch.autograd.grad(y, x, dy.view(3, 700, 640))
        torch.cuda.synchronize()
    turned = variants == ""
    assert _kernel_launches(prof, "fp8_e4m3_kernel") == ["false" if turned else "true"]
    assert sum("transpose_fp8_kernel" in e.name for e in prof.events()) == turned
    assert torch.equal(y, torch.nn.functional.linear(x, dequantize_fp8(q, scale, torch.bfloat16).cuda()))
    ratio = assert_within(dx.reshape(2100, 384).cpu(), _path_a_grouped_bound(dy, q[None], scale[None], [2100], True),
                          "x's gradient")
    print(f"dense backward on FP8 tensor cores: max |error| / bound = {ratio:.3f}")


def test_an_unknown_fp8_tensor_core_product_is_refused_on_any_device(monkeypatch):
    """A misspelt product in V4TRAIN_FP8_TENSOR_CORES is an error naming the variable and the word,
    on the CPU too (where no FP8 tensor core would read it)."""
    monkeypatch.setenv("V4TRAIN_FP8_TENSOR_CORES", "experts,dense_bwd")
    gen = torch.Generator().manual_seed(31)
    q, scale = blocks_of_sizes((128, 128), gen)
    with pytest.raises(ValueError, match=r"V4TRAIN_FP8_TENSOR_CORES=experts,dense_bwd: unknown product 'dense_bwd'"):
        v4_linear_test.linear(activations(4, 128, gen, signed=True), Linear(q, scale))
