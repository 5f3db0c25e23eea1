"""A CPU check of the plane kernels' fragment addresses (cc/ops/gated_delta_rule.cu, kPlanes): each
warp's ldmatrix row addresses, as the kernels compute them, fed to an emulation of ldmatrix and
mma.m16n8k16 (the PTX ISA's "Matrix Fragments for mma.m16n8k16" and ldmatrix's per-thread layout),
must give every tile of the product the numpy product gives. The address lambdas below mirror the
kernels' (plane_gemm's four operand layouts, the recurrence's two products and its state's lane pairs);
change both together.
A wrong address (the untransposed read of a transposed operand) is checked to fail, so the check can.

    python3 tools/mma_fragments_check.py
"""

from __future__ import annotations

import numpy as np


def ldmatrix(mem, address, count, trans):
    """ldmatrix.m8n8.x{count}[.trans].b16: lanes 8i..8i+7 give the rows (row, column of 8 values) of
    matrix i; lane l receives, of each matrix, row l / 4, columns 2 (l % 4) and + 1 (of the stored
    matrix transposed where trans). Returns regs[lane][i] = (first, second)."""
    regs = [[None] * count for _ in range(32)]
    for i in range(count):
        m = np.array([mem[r, c:c + 8] for r, c in (address(8 * i + j) for j in range(8))])
        m = m.T if trans else m
        for lane in range(32):
            regs[lane][i] = (m[lane // 4, 2 * (lane % 4)], m[lane // 4, 2 * (lane % 4) + 1])
    return regs


def mma(acc, a, b):
    """acc[lane] (4 floats) += A B for mma.m16n8k16.row.col: a[lane] four pairs (rows g, g + 8;
    columns 2t, 2t + 8), b[lane] two pairs (rows 2t, 2t + 8; column g); lane = 4 g + t."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        A[g, 2 * t:2 * t + 2], A[g + 8, 2 * t:2 * t + 2] = a[lane][0], a[lane][1]
        A[g, 2 * t + 8:2 * t + 10], A[g + 8, 2 * t + 8:2 * t + 10] = a[lane][2], a[lane][3]
        B[2 * t:2 * t + 2, g], B[2 * t + 8:2 * t + 10, g] = b[lane][0], b[lane][1]
    c = A @ B
    for lane in range(32):
        g, t = lane // 4, lane % 4
        acc[lane] += [c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1]]


def tile_matches(acc_tiles, want):
    """acc_tiles[j][lane]: the C fragments of n-tiles j against want [16, 8 * len(acc_tiles)]."""
    return all(np.isclose(acc[lane][e], want[lane // 4 + e // 2 * 8, 8 * j + 2 * (lane % 4) + e % 2])
               for j, acc in enumerate(acc_tiles) for lane in range(32) for e in range(4))


def plane_gemm(kTA, kTB, M, N, K, NT, lda, ldb, rng, wrong_b=False):
    """plane_gemm's tiles: A [M, K] stored [K, M] (kTA) or [M, K], B [K, N] stored [N, K] (kTB) or [K, N]."""
    a = rng.standard_normal((K, lda) if kTA else (M, lda))
    b = rng.standard_normal((N, ldb) if kTB else (K, ldb))
    A = a[:, :M].T if kTA else a[:, :K]
    B = b[:, :K].T if kTB else b[:, :N]
    ok, ngroups = True, N // (8 * NT)
    for tile in range(M // 16 * ngroups):
        m0, n0 = tile // ngroups * 16, tile % ngroups * 8 * NT
        acc = [[np.zeros(4) for _ in range(32)] for _ in range(NT)]
        for k0 in range(0, K, 16):
            if kTA:
                fa = ldmatrix(a, lambda l: (k0 + l % 8 + l // 16 * 8, m0 + l // 8 % 2 * 8), 4, True)
            else:
                fa = ldmatrix(a, lambda l: (m0 + l % 16, k0 + l // 16 * 8), 4, False)
            for j in range(0, NT, 2):
                if kTB and not wrong_b:
                    fb = ldmatrix(b, lambda l: (n0 + 8 * j + l // 16 * 8 + l % 8, k0 + l // 8 % 2 * 8), 4, False)
                elif kTB:  # the mistake: rows and column halves as for an A operand
                    fb = ldmatrix(b, lambda l: (n0 + 8 * j + l % 16, k0 + l // 16 * 8), 4, False)
                else:
                    fb = ldmatrix(b, lambda l: (k0 + l % 16, n0 + 8 * j + l // 16 * 8), 4, True)
                mma(acc[j], fa, [(f[0], f[1]) for f in fb])
                mma(acc[j + 1], fa, [(f[2], f[3]) for f in fb])
        ok &= tile_matches(acc, A[m0:m0 + 16] @ B[:, n0:n0 + 8 * NT])
    return ok


def recurrence(rng):
    """recurrence_planes_kernel's products, warp w of 16: x [64, 32] = a [64, 128] S [128, 32] (S
    stored [K, N], x2.trans), then S [128, 32] = b^T x, b [64, 128] read transposed."""
    a, b = rng.standard_normal((64, 136)), rng.standard_normal((64, 136))
    S, X = rng.standard_normal((128, 40)), rng.standard_normal((64, 40))
    ok = True
    for w in range(16):
        x0, xc, s0, sc = w // 4 * 16, w % 4 * 8, w // 2 * 16, w % 2 * 16
        acc = [np.zeros(4) for _ in range(32)]
        for k0 in range(0, 128, 16):
            fa = ldmatrix(a, lambda l: (x0 + l % 16, k0 + l // 16 * 8), 4, False)
            fb = ldmatrix(S, lambda l: (k0 + l % 16, xc), 2, True)
            mma(acc, fa, [(f[0], f[1]) for f in fb])
        ok &= tile_matches([acc], a[x0:x0 + 16, :128] @ S[:128, xc:xc + 8])
        acc2 = [[np.zeros(4) for _ in range(32)] for _ in range(2)]
        for k0 in range(0, 64, 16):
            fa = ldmatrix(b, lambda l: (k0 + l % 8 + l // 16 * 8, s0 + l // 8 % 2 * 8), 4, True)
            fb = ldmatrix(X, lambda l: (k0 + l % 16, sc + l // 16 * 8), 4, True)
            for j in range(2):
                mma(acc2[j], fa, [(f[2 * j], f[2 * j + 1]) for f in fb])
        ok &= tile_matches(acc2, b[:64, s0:s0 + 16].T @ X[:64, sc:sc + 16])
    return ok


def h_out_pairs(rng, wrong=False):
    """recurrence_planes_kernel's state written out 8 bytes a lane: each lane holds its S tile's
    fragment (state[j][e] at row s0 + g + 8 (e / 2), column sc + 8 j + 2 t + e % 2); lanes t and t ^ 1
    swap a pair (__shfl_xor_sync(.., 1)), the even one writing columns sc + 2 t.. + 3, the odd one sc +
    8 + 2 (t - 1).. + 3. Every element of S [128, 32] written once, with its own value. wrong: the odd
    lane's two pairs in the wrong order (the mutation delta_rule_recurrence_h_pairs_swapped)."""
    S = rng.standard_normal((128, 32))
    out, count = np.zeros((128, 32)), np.zeros((128, 32), dtype=int)
    for w in range(16):
        s0, sc = w // 2 * 16, w % 2 * 16
        state = [[[S[s0 + l // 4 + 8 * (e // 2), sc + 8 * j + 2 * (l % 4) + e % 2] for e in range(4)]
                  for j in range(2)] for l in range(32)]
        for half in range(2):
            p0 = [tuple(state[l][0][2 * half:2 * half + 2]) for l in range(32)]
            p1 = [tuple(state[l][1][2 * half:2 * half + 2]) for l in range(32)]
            send = [p0[l] if l % 4 % 2 else p1[l] for l in range(32)]
            for l in range(32):
                g, t = l // 4, l % 4
                odd, got = t & 1, send[l ^ 1]
                r, c = s0 + g + 8 * half, sc + (8 if odd else 0) + 2 * (t & ~1)
                lo, hi = ((p1[l], got) if wrong else (got, p1[l])) if odd else (p0[l], got)
                out[r, c:c + 4] = lo + hi
                count[r, c:c + 4] += 1
    return bool((count == 1).all() and np.array_equal(out, S))


def main() -> int:
    rng = np.random.default_rng(0)
    checks = {
        "recurrence's two products": recurrence(rng),
        "the recurrence's state written 8 bytes a lane (a pair swapped between lanes)": h_out_pairs(rng),
        "state_grads (A [M, K], B stored [N, K])": plane_gemm(False, True, 128, 128, 128, 4, 136, 136, rng),
        "local_grads (A stored [K, M], B [K, N])": plane_gemm(True, False, 192, 128, 64, 4, 200, 136, rng),
        "output (A [M, K] at pitch 200, B [K, N] at pitch 40)": plane_gemm(False, False, 64, 32, 192, 2, 200, 40, rng),
        "intra_grads' dPL and Q K^T, wy_grads' K K^T, [P | E Q]'s Q K^T (A [M, K], B stored [N, K], pitch 136)":
            plane_gemm(False, True, 64, 64, 128, 2, 136, 136, rng),
        "intra_grads' dq part (A [M, K] at pitch 72, B [K, N] at 136)":
            plane_gemm(False, False, 64, 128, 64, 4, 72, 136, rng),
        "intra_grads' dk part (A stored [K, M] at pitch 72, B [K, N] at 136)":
            plane_gemm(True, False, 64, 128, 64, 4, 72, 136, rng),
    }
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    wrong = plane_gemm(False, True, 32, 32, 32, 2, 40, 40, rng, wrong_b=True)
    print(f"{'ok  ' if not wrong else 'FAIL'} a wrong B address fails the check")
    wrong_pairs = h_out_pairs(rng, wrong=True)
    print(f"{'ok  ' if not wrong_pairs else 'FAIL'} the odd lane's pairs swapped fail the state's check")
    return 0 if all(checks.values()) and not wrong and not wrong_pairs else 1


if __name__ == "__main__":
    raise SystemExit(main())
