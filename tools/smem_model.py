"""Shared memory as the CPU checks of the CUDA kernels model it (tools/*_check.py): a warp's
wavefronts, and TMA's swizzles."""

from __future__ import annotations

import collections


def wavefronts(addresses: list[int], width: int) -> int:
    """Shared-memory wavefronts of a warp's access of `width` bytes a lane (lane order): up to 4 bytes
    the whole warp at once, 8 in half-warps, 16 in quarter-warps (128 bytes a phase); a wavefront
    serves one 4-byte word a bank (a word broadcast to every lane reading it)."""
    lanes = 32 * 4 // max(width, 4)
    total = 0
    for i in range(0, len(addresses), lanes):
        banks = collections.defaultdict(set)
        for a in addresses[i:i + lanes]:
            for w in range(max(width, 4) // 4):
                banks[(a // 4 + w) % 32].add(a // 4 + w)
        total += max(len(v) for v in banks.values())
    return total


def sw64(offset: int) -> int:
    """TMA's 64-byte swizzle of a linear byte offset in a tile on 512 bytes: bits 4-5 ^= bits 7-8."""
    return offset ^ (((offset >> 7) & 3) << 4)


def sw128(offset: int) -> int:
    """TMA's 128-byte swizzle of a linear byte offset in a tile on 1,024 bytes: bits 4-6 ^= bits 7-9
    (a 128-byte row's 16-byte chunk c at c ^ row % 8)."""
    return offset ^ (((offset >> 7) & 7) << 4)
