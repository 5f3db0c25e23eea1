"""A CPU check of fp8_registers_kernel (cc/common/fp8_grouped.cu, the experts' forward and backward
unless V4TRAIN_FP8_GROUPED_VARIANTS=staged): the FP8 weight as wgmma's A operand from registers, x's tile as B. The
index math below mirrors the kernel's (Rs<BT>, `chunk`, `frag`, `st_at`, the copy out, the consumer
loop); change both together. Checked:

- the carve (Rs<BT>::kSmem) fits a block with the 1,024 bytes of alignment slack, its tiles start where
  their swizzles need (x's on 1,024 bytes, the weight's on 512, transposed 1,024), the barriers and scales fit their 256
  bytes, and no two regions overlap;
- the A fragments: each thread's 2-byte loads, read through TMA's 64-byte swizzle (address bits 4-5 ^=
  bits 7-8) of the weight's tile of 128 rows x 64 bytes, give exactly the (row, column) pairs wgmma's
  A layout wants of it (thread (warp w, lane l): rows 16 w + l / 4 (+8), columns 2 (l % 4) (+1) (+8) of
  each 16-column slice), every byte of the tile read once; a warp's loads of one register meet each
  bank once (one wavefront). A wrong variant (a fragment's rows +8 taken from the first 8: the CUDA
  mutation fp8_registers_rows_below) is checked to fail, so the check can;
- the products' order: the consumer loop, replayed against wgmma's groups (commit, wait_group 1),
  never converts into a fragment an uncompleted product reads, releases a stage only once every
  product reading it completed, and sums the k16 slices in order 0, 1, .. (fp8_grouped_kernel's);
- the epilogue: stmatrix .trans of the accumulator fragments (y^T: rows features, columns tokens)
  into the warpgroup's token rows, then each token's 128 bytes copied out: every (token, feature) of
  a tile written once, with its own value, rows past the expert's end never; the stores' and reads'
  wavefronts; and over experts of 3000, 0, 1, 129 and 9000 rows, the persistent blocks' tiles
  (find_tile's order, feature tiles fastest) write every element of y once.

And its transposed instance (fp8_registers_kernel<true>, the backward dx = dy W_e:
A = W_e^T, M the in features, K out):

- the weight's box as TMA lays it (64 rows of out x 128 bytes of in, the 128-byte swizzle: address bits
  4-6 ^= bits 7-9), its coordinates and the scale block each step reads;
- the A fragments: two ldmatrix .x4 .trans a step (`ld_at`), each lane's registers byte-permuted
  (0x3120) and split into pairs, give every thread the (feature, k) pairs wgmma's A layout wants with
  its rows permuted (fragment row g: the warp's feature 2 g, g + 8: 2 g + 1), each byte of the tile
  read once a step, each matrix's 8 rows one wavefront. A wrong variant (the addresses without the
  swizzle: the CUDA mutation fp8_registers_backward_unswizzled) is checked to fail;
- the epilogue: each thread's 4-byte words (features 2 g, 2 g + 1 of a token) into the token rows,
  one wavefront a store, then the forward's copy out: every (token, feature) once with its own value.

    python3 tools/fp8_registers_check.py
"""

from __future__ import annotations

import collections
import itertools

from smem_model import sw64, sw128, wavefronts

BK, ROWS, THREADS = 64, 128, 384  # kBK, kRsRows, kThreads
MAX_SMEM = 232448  # cudaDevAttrMaxSharedMemoryPerBlockOptin on the H100 (227 KB)


class Rs:
    """Rs<BT>'s constants."""

    def __init__(self, bt: int):
        self.BT = bt
        self.x_tile = bt * BK * 2
        self.w_tile = ROWS * BK
        self.stage = self.x_tile + self.w_tile
        self.stages = 5 if bt == 256 else 8
        self.chunk, self.pitch = 32, 144
        self.chunk_bytes = self.chunk * self.pitch
        self.barriers = 256
        self.smem = self.stages * self.stage + self.barriers + 2 * 2 * self.chunk_bytes + 1024


def carve(s: Rs) -> dict[str, tuple[int, int]]:
    """The regions (byte ranges after the 1,024-byte alignment) as the kernel takes them."""
    at = {}
    for i in range(s.stages):
        at[f"x{i}"] = (i * s.stage, i * s.stage + s.x_tile)
        at[f"w{i}"] = (i * s.stage + s.x_tile, (i + 1) * s.stage)
    ring = s.stages * s.stage
    at["full"] = (ring, ring + 8 * s.stages)
    at["empty"] = (ring + 8 * s.stages, ring + 16 * s.stages)
    at["scales"] = (ring + 16 * s.stages, ring + 20 * s.stages)
    epi = ring + s.barriers
    for wg, b in itertools.product(range(2), range(2)):
        a = epi + (wg * 2 + b) * s.chunk_bytes
        at[f"epilogue{wg}.{b}"] = (a, a + s.chunk_bytes)
    return at


def check_carve(s: Rs) -> dict[str, tuple[int, int]]:
    at = carve(s)
    assert s.smem <= MAX_SMEM, (s.BT, s.smem)
    assert max(b for _, b in at.values()) + 1024 == s.smem, "the carve's end and kSmem"
    assert at["scales"][1] <= at["full"][0] + s.barriers, "barriers and scales past their 256 bytes"
    spans = sorted(at.values())
    assert all(b0 <= a1 for (_, b0), (a1, _) in zip(spans, spans[1:])), "regions overlap"
    for name, (a, _) in at.items():
        need = {"x": 1024, "w": 1024, "full": 8, "empty": 8, "scales": 4}.get(name.rstrip("0123456789"), 16)
        assert a % need == 0, (name, a)
    return at


def tma_weight_tile() -> dict[int, tuple[int, int]]:
    """Where TMA puts the box of 128 rows x 64 bytes: physical offset -> (row, byte)."""
    return {sw64(r * BK + c): (r, c) for r in range(ROWS) for c in range(BK)}


FRAG = (0, 8 * BK, 8, 8 * BK + 8)  # the kernel's frag[4]
FRAG_ROWS_BELOW_WRONG = (0, 0, 8, 8)  # the mutation: rows +8 read from the first 8


def fragment_offsets(wg: int, warp: int, lane: int, kk: int, frag=FRAG) -> list[int]:
    """The byte offsets in the weight tile of thread (wg, warp, lane)'s four 2-byte pairs of slice kk."""
    row0 = 64 * wg + 16 * warp + lane // 4
    chunk = row0 * BK + ((kk ^ (lane // 8)) * 16) + 2 * (lane % 4)
    return [chunk + f for f in frag]


def wanted(wg: int, warp: int, lane: int, kk: int) -> list[tuple[int, int]]:
    """wgmma's A fragment (mma_rs's comment): a[0] (row, col), a[1] (row + 8, col), a[2] (row, col + 8),
    a[3] (row + 8, col + 8), row 16 warp + lane / 4 of the warpgroup's 64, col 2 (lane % 4) of the
    slice; each register's low half the pair's first column."""
    row, col = 64 * wg + 16 * warp + lane // 4, 16 * kk + 2 * (lane % 4)
    return [(row, col), (row + 8, col), (row, col + 8), (row + 8, col + 8)]


def check_fragments(frag=FRAG) -> int:
    """Every thread's fragment bytes are the (row, column) pairs wgmma wants, each byte of the tile read
    once a step; returns the most wavefronts of a warp's load."""
    tile = tma_weight_tile()
    seen = collections.Counter()
    worst = 0
    for wg, warp, kk in itertools.product(range(2), range(4), range(4)):
        for i in range(4):
            offsets = [fragment_offsets(wg, warp, lane, kk, frag)[i] for lane in range(32)]
            worst = max(worst, wavefronts(offsets, 2))
        for lane in range(32):
            for off, (row, col) in zip(fragment_offsets(wg, warp, lane, kk, frag), wanted(wg, warp, lane, kk)):
                assert off % 2 == 0, "a 2-byte load off its alignment"
                got = [tile[off], tile[off + 1]]  # the low byte: the register's low half, the first column
                assert got == [(row, col), (row, col + 1)], (wg, warp, lane, kk, off, got, (row, col))
                seen[off] += 1
                seen[off + 1] += 1
    assert set(seen) == set(tile) and set(seen.values()) == {1}, "a byte of the tile read twice or never"
    return worst


def replay_products(steps: int, tiles: int) -> None:
    """The consumer loop's order of events (fp8_registers_kernel: load, convert, fence / mma / commit /
    wait<1>, the empty arrivals), replayed against wgmma's groups: a convert never writes a fragment
    an uncompleted group reads; a stage is released only when no uncompleted group reads it, and each
    step's stage exactly once; the slices reach the accumulator in order."""
    in_flight: list[tuple[int, int]] = []  # (fragment buffer, stage step) of each uncommitted-or-pending group
    released, order = [], []
    it = 0

    def convert(buffer: int) -> None:
        assert all(b != buffer for b, _ in in_flight), f"fragment {buffer} overwritten under a product"

    def release(step_it: int) -> None:
        assert all(s != step_it for _, s in in_flight), f"step {step_it}'s stage released under a product"
        released.append(step_it)

    for _ in range(tiles):
        convert(0)  # load(it); convert(af[0], raw[0])
        for step in range(steps):
            for kk in range(4):
                in_flight.append((kk % 2, it))  # mma_rs(acc, af[kk % 2], x's slice kk of stage it); commit
                order.append(4 * step + kk)
                in_flight[:] = in_flight[-1:]  # wait<1>
                if kk == 0 and step > 0:
                    release(it - 1)
                if kk < 3:
                    convert((kk + 1) % 2)
                elif step + 1 < steps:
                    convert(0)  # load(it + 1); convert(af[0], raw[0])
            it += 1
        in_flight.clear()  # wait<0>
        release(it - 1)
        assert order == list(range(4 * steps)), "the slices out of order"
        order.clear()
    assert released == list(range(it)), "a stage released twice or never"


def stmatrix_trans(regs: list[list[object]], addresses: list[int], memory: dict[int, object]) -> None:
    """stmatrix.m8n8.x4.trans.b16: regs[lane][i] = (lo, hi), matrix i's fragment (lane l: row l / 4,
    columns 2 (l % 4), +1); the 16 bytes at addresses[8 i + r] get matrix i's column r (rows 0..7),
    2 bytes each (memory holds one value a 2-byte element)."""
    for i, r in itertools.product(range(4), range(8)):
        for row in range(8):
            lane = 4 * row + r // 2
            a = addresses[8 * i + r] + 2 * row
            assert a not in memory, "a staged element stored twice in a chunk"
            memory[a] = regs[lane][i][r % 2]


def accumulator(wg: int, warp: int, lane: int, index: int) -> tuple[int, int]:
    """The (feature, token) of a thread's accumulator acc[index] in the tile (wgmma's D fragment of
    y^T: rows 16 warp + lane / 4 (+8), columns 8 j + 2 (lane % 4) (+1) as acc[4 j..4 j + 3])."""
    j, e = index // 4, index % 4
    return 64 * wg + 16 * warp + lane // 4 + 8 * (e // 2), 8 * j + 2 * (lane % 4) + e % 2


def epilogue(s: Rs, first: int, end: int, f0: int, out: int, transposed: bool = False, permuted: bool = True):
    """The kernel's epilogue of one tile (tokens first.., features f0..) on symbolic values: y's
    elements written {(row, column): value}, each value the (feature, token) of the accumulator it came
    from; and the most wavefronts of one transposed matrix's store (its 8 rows of 16 bytes) and of a
    warp's 16-byte reads of the staged rows. Transposed: each thread's words of features 2 g, 2 g + 1
    (fragment rows g, g + 8; unpermuted, the wrong map: features g, g + 8), the most wavefronts of a
    store of one word a lane."""
    at = carve(s)
    y, stores, reads_worst = {}, 0, 0
    for wg in range(2):
        base = at[f"epilogue{wg}.0"][0]
        for c in range(s.BT // s.chunk):
            buffer = (c % 2) * s.chunk_bytes
            memory: dict[int, object] = {}
            for warp in range(4):
                if transposed:
                    for j, e in itertools.product(range(4 * c, 4 * c + 4), range(2)):
                        # the store of token 8 j + 2 (lane % 4) + e: pack_bf16(acc[4 j + e], acc[4 j + e + 2])
                        addresses = []
                        for lane in range(32):
                            g, t = lane // 4, lane % 4
                            row0 = base + buffer + (8 * j - s.chunk * c + 2 * t + e) * s.pitch
                            addresses.append(row0 + (16 * warp + 2 * g) * 2)
                            for half in range(2):  # the low half fragment row g, the high g + 8
                                row, token = accumulator(wg, warp, lane, 4 * j + e + 2 * half)
                                i = row % 16  # the value: A's row i is the warp's feature feature_of_row(i)
                                a = row0 + (16 * warp + (2 * g + half if permuted else i)) * 2
                                assert a not in memory, "a staged element stored twice in a chunk"
                                memory[a] = (row - i + feature_of_row(i), token)
                        stores = max(stores, wavefronts(addresses, 4))
                    continue
                for h in range(2):
                    j = 4 * c + 2 * h
                    regs, addresses = [], []
                    for lane in range(32):
                        acc = lambda i: accumulator(wg, warp, lane, i)  # noqa: E731
                        regs.append([(acc(4 * j + 2 * m), acc(4 * j + 2 * m + 1)) for m in range(4)])
                        st_at = base + (8 * (lane // 16) + lane % 8) * s.pitch + (16 * warp + 8 * (lane // 8 % 2)) * 2
                        addresses.append(st_at + buffer + 16 * h * s.pitch)
                    for i in range(4):  # one matrix a wavefront when its 8 rows meet every bank once
                        stores = max(stores, wavefronts(addresses[8 * i:8 * i + 8], 16))
                    stmatrix_trans(regs, addresses, memory)
            for warp in range(4):  # named_sync, then the copy out
                for u in range(2):
                    reads = []
                    for lane in range(32):
                        p = 32 * warp + lane
                        r, row = p // 8 + 16 * u, first + s.chunk * c + p // 8 + 16 * u
                        a = base + buffer + r * s.pitch + p % 8 * 16
                        reads.append(a)
                        if row < end:
                            for e in range(8):
                                col = f0 + 64 * wg + p % 8 * 8 + e
                                assert (row, col) not in y and col < out, "an element of y written twice"
                                y[(row, col)] = memory[a + 2 * e]
                    reads_worst = max(reads_worst, wavefronts(reads, 16))
    return y, stores, reads_worst


def check_epilogue(s: Rs, transposed: bool = False, permuted: bool = True) -> tuple[int, int]:
    """One tile of 100 rows (a partial one: rows past the end not written) at features 128..: every
    element once, with its own value. The wavefronts: a matrix's store (transposed: a word a lane) 1, a
    warp's read of 512 bytes 4."""
    first, end, f0 = 7, 107, 128
    y, stores, reads = epilogue(s, first, end, f0, 384, transposed, permuted)
    want = {(first + t, f0 + f): (f, t) for f in range(ROWS) for t in range(s.BT) if first + t < end}
    assert y == want, "the epilogue's elements"
    assert (stores, reads) == (1, 4), (stores, reads)
    return stores, reads


# ---- The transposed instance: the weight's tile [64 k (out) x 128 m (in)] as A = its transpose.
def tma_weight_tile_t() -> dict[int, tuple[int, int]]:
    """Where TMA puts the box of 64 rows (k: out) x 128 bytes (m: in): physical offset -> (k, m)."""
    return {sw128(k * 128 + m): (k, m) for k in range(BK) for m in range(ROWS)}


def ld_at(wg: int, warp: int, lane: int, swizzled: bool = True) -> int:
    """The kernel's `ld_at` less the stage: lane l names row l of a load's 32 (+ 32 q for load q),
    the warp's 16-byte chunk 4 wg + warp, moved by the swizzle (the mutation: unmoved)."""
    chunk = 4 * wg + warp
    return lane * 128 + ((chunk ^ (lane % 8)) if swizzled else chunk) * 16


def ldmatrix_trans_x4(addresses: list[int], tile: dict[int, object]) -> list[list[list[object]]]:
    """ldmatrix.m8n8.x4.trans.b16: lane 8 i + r gives row r of matrix i (16 bytes); lane l's register i
    holds matrix i's elements (row 2 (l % 4), column l / 4) low and (row 2 (l % 4) + 1, column l / 4)
    high, an element 2 bytes (low first): the register's 4 bytes, lowest first."""
    regs = []
    for lane in range(32):
        r, c = 2 * (lane % 4), lane // 4
        regs.append([[tile[addresses[8 * i + r + d] + 2 * c + b] for d in range(2) for b in range(2)]
                     for i in range(4)])
    return regs


def byte_perm(v: list[object], selector: int) -> list[object]:
    """__byte_perm(v, 0, selector) on the bytes of v (selectors 0-3 only)."""
    return [v[(selector >> 4 * i) & 0xF] for i in range(4)]


def feature_of_row(i: int) -> int:
    """The transposed fragment's row order within a warp's 16: row g is feature 2 g, g + 8 is 2 g + 1."""
    return 2 * (i % 8) + i // 8


def check_fragments_t(swizzled: bool = True) -> int:
    """Every thread's converted pairs (f[0..3] of each slice) are the (k, feature) pairs of wgmma's A
    layout with its rows permuted (A = W^T: row m, column k is the tile's byte (k, m)); each byte of the
    tile read once a step; returns the most wavefronts of a matrix of an ldmatrix."""
    tile = tma_weight_tile_t()
    seen = collections.Counter()
    worst = 0
    for wg, warp in itertools.product(range(2), range(4)):
        lanes = [[[None] * 2 for _ in range(4)] for _ in range(32)]  # each lane's raw[kk][h]
        for q in range(2):
            addresses = [ld_at(wg, warp, lane, swizzled) + q * 32 * 128 for lane in range(32)]
            for i in range(4):
                worst = max(worst, wavefronts(addresses[8 * i:8 * i + 8], 16))
                for r in range(8):
                    for b in range(16):
                        seen[addresses[8 * i + r] + b] += 1
            regs = ldmatrix_trans_x4(addresses, tile)
            for lane in range(32):  # (raw[2 q][0], raw[2 q][1], raw[2 q + 1][0], raw[2 q + 1][1]) = d0..d3
                lanes[lane][2 * q][0], lanes[lane][2 * q][1] = regs[lane][0], regs[lane][1]
                lanes[lane][2 * q + 1][0], lanes[lane][2 * q + 1][1] = regs[lane][2], regs[lane][3]
        for lane, kk in itertools.product(range(32), range(4)):
            f = []
            for h in range(2):
                b = byte_perm(lanes[lane][kk][h], 0x3120)
                f += [b[0:2], b[2:4]]  # e4m3x4_to_half2x2: the low 16 bits (lo), the high (hi)
            g, t = lane // 4, lane % 4
            for j, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
                m, k = 64 * wg + 16 * warp + feature_of_row(row), 16 * kk + col
                assert f[j] == [(k, m), (k + 1, m)], (wg, warp, lane, kk, j, f[j], (k, m))
    assert set(seen) == set(tile) and set(seen.values()) == {1}, "a byte of the tile read twice or never"
    return worst


def check_box_and_scales(E: int = 3, out: int = 640, inp: int = 384) -> None:
    """Tile (expert e, features f0..) at step n: TMA's box at (column f0, row e out + 64 n) holds
    W[e, 64 n + k, f0 + m] at (k, m), A's (m, k) = W^T's; the scale read there (the producer's pointer,
    + n 64 / 128 blocks_in) is block (e, 64 n / 128, f0 / 128) of [E, out / 128, in / 128]; the forward's
    (row e out + f0, column 64 n) and block (e, f0 / 128, 64 n / 128)."""
    blocks_in = inp // 128
    for e, n in itertools.product(range(E), range(out // BK)):
        for f0 in range(0, inp, ROWS):
            col, row = f0, e * out + 64 * n  # transposed: (f0, w_row + step * kBK), w_row = e out
            assert (row - e * out, col) == (BK * n, f0)
            scale = (e * (out // 128) + 0) * blocks_in + f0 // 128 + n * BK // 128 * blocks_in
            assert scale == (e * (out // 128) + BK * n // 128) * blocks_in + f0 // 128
    for e, n in itertools.product(range(E), range(inp // BK)):
        for f0 in range(0, out, ROWS):
            scale = (e * (out // 128) + f0 // 128) * blocks_in + 0 + n * BK // 128 * 1
            assert scale == (e * (out // 128) + f0 // 128) * blocks_in + BK * n // 128


def find_tiles(counts: list[int], bt: int) -> list[tuple[int, int, int]]:
    """find_tile's row tiles in order: (expert, first, end), ceil(rows / BT) an expert."""
    tiles, start = [], 0
    for e, n in enumerate(counts):
        end = start + n
        tiles += [(e, start + i * bt, end) for i in range(-(-n // bt))]
        start = end
    return tiles


def check_grid(s: Rs, counts: list[int], out: int, blocks: int) -> None:
    """The persistent blocks' tiles (t = block, + blocks..; feature tiles fastest) cover y [rows, out]
    once: rows by tile, each tile's features f0.. written by its epilogue (its rows before end)."""
    row_tiles, col_tiles = find_tiles(counts, s.BT), out // ROWS
    written = collections.Counter()
    for b in range(blocks):
        for t in range(b, len(row_tiles) * col_tiles, blocks):
            _, first, end = row_tiles[t // col_tiles]
            f0 = t % col_tiles * ROWS
            for row in range(first, min(first + s.BT, end)):
                written[(row, f0)] += 1
    assert set(written.values()) == {1} and len(written) == sum(counts) * col_tiles, "y's tiles"


def main() -> int:
    for bt in (256, 128):
        s = Rs(bt)
        check_carve(s)
        print(f"Rs<{bt}>: {s.stages} stages of {s.stage} bytes (x {s.x_tile}, weight {s.w_tile}), barriers "
              f"{s.barriers}, epilogue 2 x 2 x {s.chunk_bytes}: {s.smem} bytes with the slack, of {MAX_SMEM}")
        stores, reads = check_epilogue(s)
        print(f"  epilogue: every element of a partial tile once with its value; wavefronts: {stores} a transposed "
              f"matrix's store, {reads} a warp's read of 4 rows")
        stores, reads = check_epilogue(s, transposed=True)
        print(f"  transposed epilogue: every element once with its value (fragment rows permuted back); "
              f"wavefronts: {stores} a word a lane's store, {reads} a warp's read of 4 rows")
        try:
            check_epilogue(s, transposed=True, permuted=False)
        except AssertionError:
            pass
        else:
            raise AssertionError("a transposed epilogue that stores fragment row i as feature i passed")
        check_grid(s, [3000, 0, 1, 129, 9000], 640, 132)
        check_grid(s, [5, 300, 0, 700], 256, 7)
        check_grid(s, [3000, 0, 1, 129, 9000], 384, 132)  # (transposed: N the weight's in)
        replay_products(steps=6, tiles=3)
        replay_products(steps=2, tiles=2)
    worst = check_fragments()
    assert worst == 1, worst
    print(f"fragments: every thread's pairs are wgmma's A layout through TMA's 64-byte swizzle, each byte once; "
          f"{worst} wavefront a warp's load")
    try:
        check_fragments(FRAG_ROWS_BELOW_WRONG)
    except AssertionError:
        pass
    else:
        raise AssertionError("fragments whose rows +8 come from the first 8 passed")
    worst = check_fragments_t()
    assert worst == 1, worst
    print(f"transposed fragments: ldmatrix .trans through TMA's 128-byte swizzle and the byte permute give every "
          f"thread wgmma's A layout, rows permuted, each byte once; {worst} wavefront a matrix")
    try:
        check_fragments_t(swizzled=False)
    except AssertionError:
        pass
    else:
        raise AssertionError("transposed fragments read without the swizzle passed")
    check_box_and_scales()
    check_box_and_scales(E=2, out=256, inp=1024)
    print("transposed box and scales: the box at (f0, e out + 64 n), the scale block (e, 64 n / 128, f0 / 128)")
    print("products: no fragment overwritten and no stage released under a product; the slices in order")
    print("grid: every element of y once (experts of 3000, 0, 1, 129, 9000 rows; 132 blocks)")
    # Shared memory's traffic a 64-wide step of a 128 x 256 tile, in 128-byte wavefronts, against the
    # products' 1,024 cycles at peak (fp8_grouped_kernel's, the brief's count: 144 KB, 1,152).
    s = Rs(256)
    x_reads = 2 * 4 * 256 * 32  # two warpgroups, four slices, 256 rows of 32 bytes
    frag = 8 * 4 * 4  # 8 warps, 4 slices, 4 loads: one wavefront each
    traffic = (s.x_tile + s.w_tile + x_reads) // 128 + frag
    print(f"a step's shared-memory wavefronts (Rs<256>): copies {(s.x_tile + s.w_tile) // 128}, x's reads "
          f"{x_reads // 128}, fragments {frag}: {traffic} against 1,024 cycles of products (1,152 unasked)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
