"""A CPU check of the experts' FP8 kernel's backward transposition (cc/common/fp8_grouped.cu,
transpose_tile): a weight tile of 128 rows x 128 bytes, copied by TMA with the 128-byte swizzle,
turned into its transpose in the same swizzle (the K-major operand an 8-bit wgmma reads). The
index math below mirrors the kernel's; change both together. Checked: the 128 threads' eight
4 x 4 blocks cover the tile once; each warp's 32 loads (and 32 stores) of a word meet 32 banks;
and an emulation of the loads, __byte_perm and the stores gives every byte its transposed place.
A wrong variant (stores without the swizzle) is checked to fail, so the check can. Then
transpose_fp8_kernel (the backward's weight turned once in global memory, a 128 x 128 tile a
block through transpose_tile): its 16-byte loads into the swizzle and stores out of it, emulated
over a weight of 2 x 3 tiles, give the weight's transpose; stores that keep the swizzle do not.

    python3 tools/fp8_transpose_check.py
"""

from __future__ import annotations

import random

from smem_model import sw128


def swizzled(row: int, byte: int) -> int:
    """Byte (row, byte) of a tile of 128-byte rows with the 128-byte swizzle (chunk ^= row % 8)."""
    return sw128(row * 128 + byte)


def blocks(t: int):
    """Thread t's (i, kb, nb): as transpose_tile's nb = lane, kb = h(lane) ^ (8 warp + i)."""
    warp, nb = t // 32, t % 32
    h = (nb >> 2 & 3) | (nb >> 1 & 1) << 2 | (nb >> 4 & 1) << 3
    return [(i, h ^ (8 * warp + i), nb) for i in range(8)]


def load_address(kb: int, nb: int, j: int) -> int:
    return swizzled(4 * kb + j, 4 * nb)


def store_address(kb: int, nb: int, b: int, swizzle: bool = True) -> int:
    n = 4 * nb + b
    return swizzled(n, 4 * kb) if swizzle else n * 128 + 4 * kb


def byte_perm(x: int, y: int, s: int) -> int:
    """CUDA's __byte_perm: byte i of the result is byte (nibble i of s) % 8 of y:x (x the low word)."""
    both = x | y << 32
    return sum(((both >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def transpose(raw: bytes, swizzle: bool = True) -> bytearray:
    """transpose_tile on the bytes of `raw` (as TMA laid them), every thread and block."""
    out = bytearray(len(raw))
    word = lambda a: int.from_bytes(raw[a:a + 4], "little")  # noqa: E731
    for t in range(128):
        for _, kb, nb in blocks(t):
            w = [word(load_address(kb, nb, j)) for j in range(4)]
            lo01, lo23 = byte_perm(w[0], w[1], 0x5140), byte_perm(w[2], w[3], 0x5140)
            hi01, hi23 = byte_perm(w[0], w[1], 0x7362), byte_perm(w[2], w[3], 0x7362)
            o = [byte_perm(lo01, lo23, 0x5410), byte_perm(lo01, lo23, 0x7632),
                 byte_perm(hi01, hi23, 0x5410), byte_perm(hi01, hi23, 0x7632)]
            for b in range(4):
                a = store_address(kb, nb, b, swizzle)
                out[a:a + 4] = o[b].to_bytes(4, "little")
    return out


def problems(swizzle: bool = True) -> list[str]:
    found = []
    seen = sorted((kb, nb) for t in range(128) for _, kb, nb in blocks(t))
    if seen != [(kb, nb) for kb in range(32) for nb in range(32)]:
        found.append("the threads' blocks do not cover the 32 x 32 blocks once")
    for warp in range(4):
        for i in range(8):
            lanes = [blocks(32 * warp + lane)[i] for lane in range(32)]
            for j in range(4):
                for name, address in (("loads", lambda kb, nb: load_address(kb, nb, j)),
                                      ("stores", lambda kb, nb: store_address(kb, nb, j, swizzle))):
                    banks = {address(kb, nb) // 4 % 32 for _, kb, nb in lanes}
                    if len(banks) != 32:
                        found.append(f"warp {warp} step {i} word {j}: {name} meet {len(banks)} banks")
    rng = random.Random(0)
    logical = [[rng.randrange(256) for _ in range(128)] for _ in range(128)]  # [k][n]
    raw = bytearray(128 * 128)
    for k in range(128):
        for n in range(128):
            raw[swizzled(k, n)] = logical[k][n]
    tile = transpose(bytes(raw), swizzle)
    wrong = sum(tile[swizzled(n, k)] != logical[k][n] for k in range(128) for n in range(128))
    if wrong:
        found.append(f"{wrong} of 16384 bytes not at their transposed place")
    return found


def turn(weight: list[list[int]], unswizzle: bool = True) -> list[list[int]]:
    """transpose_fp8_kernel on `weight` [rows][cols] (multiples of 128): each block's thread t, step
    j loads row r = (t + 128 j) / 8's chunk c = t % 8 to swizzled chunk c ^ r % 8; transpose_tile;
    then stores the tile's row n's chunk c (read at chunk c ^ n % 8) to the weight's column c0 + n."""
    rows, cols = len(weight), len(weight[0])
    out = [[0] * rows for _ in range(cols)]
    for r0 in range(0, rows, 128):
        for c0 in range(0, cols, 128):
            raw = bytearray(128 * 128)
            for t in range(128):
                for j in range(8):
                    r, c = (t + 128 * j) // 8, t % 8
                    at = r * 128 + (c ^ r % 8) * 16
                    raw[at:at + 16] = bytes(weight[r0 + r][c0 + 16 * c:c0 + 16 * c + 16])
            tile = transpose(bytes(raw))
            for t in range(128):
                for j in range(8):
                    n, c = (t + 128 * j) // 8, t % 8
                    at = n * 128 + ((c ^ n % 8) if unswizzle else c) * 16
                    out[c0 + n][r0 + 16 * c:r0 + 16 * c + 16] = list(tile[at:at + 16])
    return out


def turn_problems(unswizzle: bool = True) -> list[str]:
    rng = random.Random(1)
    weight = [[rng.randrange(256) for _ in range(384)] for _ in range(256)]
    turned = turn(weight, unswizzle)
    wrong = sum(turned[c][r] != weight[r][c] for r in range(256) for c in range(384))
    return [f"the weight turned: {wrong} of {256 * 384} bytes not at their transposed place"] if wrong else []


def main() -> int:
    bad = problems() + turn_problems()
    if not turn_problems(unswizzle=False):
        print("fp8_transpose_check: the turned weight's stores keeping the swizzle pass: the check cannot fail")
        return 1
    for p in bad:
        print("fp8_transpose_check:", p)
    if not problems(swizzle=False):
        print("fp8_transpose_check: stores without the swizzle pass: the check cannot fail")
        return 1
    if not bad:
        print("fp8_transpose_check: the transposition covers the tile, meets 32 banks a warp, places every byte;"
              " the weight turned in global memory is its transpose")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
