"""A CPU check of dqkwg_planes_kernel's shared memory and index maps (cc/ops/gated_delta_rule.cu: the
backward's state_grads and intra_grads on planes, one kernel): its carve (DqkwgSmem, mirrored below: change both together) fits a
block, no region is written in a phase while another in that phase reads or writes its bytes, and
every region read finds the bytes its last writer left; each product's tile dealing (plane_gemm's
next_tile, tile_at, skip_step) hands every element of C to its epilogue once, and skips only k-steps
of zeros; every output row and pair is written once; the hot shared accesses' wavefronts. A region
placed over a live one is checked to fail, so the check can. (The operands' fragment addresses:
tools/mma_fragments_check.py, whose layouts these products share.)

    python3 tools/dqkwg_check.py
"""

from __future__ import annotations

import collections

from smem_model import wavefronts

ROWS, THREADS, WARPS = 64, 512, 16
PLANE_ROW, PLANE64, PITCH64, LDF = 136, 72, 68, 136  # kPlaneRow, kPlane64, kPitch64, DqkwgSmem::kLdF
ROW_THREADS = THREADS // ROWS
NONE, LOWER_A, UPPER_A, UPPER_B, LOWER_C = 0, 1, 2, 4, 8  # Tri
MAX_SMEM = 227 * 1024  # a block's most on sm_90


def carve(pk_offset: int = 0) -> tuple[dict[str, tuple[int, int]], int]:
    """DqkwgSmem's regions (byte ranges) and its size: Carve::take's order and 16-byte alignment; R's
    parts at their element offsets (pk_offset moves pk, for the check that the check fails)."""
    info = 64 * 8 + 64 * 8 + 3 * 64 * 4 + 4  # Info: slot, G, beta / E / Kt, gamma
    info = (info + 7) // 8 * 8
    plane_tile = ROWS * PLANE_ROW
    takes = [("info", info), ("dG", 64 * 8), ("t", 64 * 8), ("rq", 64 * 4), ("rk", 64 * 4), ("scratch", WARPS * 4),
             ("q", plane_tile * 2), ("k", plane_tile * 2), ("S", 2 * plane_tile * 2), ("DQ", ROWS * LDF * 4),
             ("Z", ROWS * PITCH64 * 4), ("R", 6 * plane_tile * 2)]
    at, used = {}, 0
    for name, n in takes:
        used = (used + 15) // 16 * 16
        at[name] = (used, used + n)
        used += n
    r0, r1 = at.pop("R")
    dkt = plane_tile
    pk = dkt + 2 * ROWS * LDF + pk_offset
    pq = pk + 2 * ROWS * PLANE64
    parts = {"v_hi": (0, plane_tile), "v_lo": (plane_tile, 2 * plane_tile), "H": (2 * plane_tile, 4 * plane_tile),
             "Y_do": (4 * plane_tile, 5 * plane_tile), "Y_dv": (5 * plane_tile, 6 * plane_tile),
             "DKT": (dkt, dkt + 2 * ROWS * LDF), "pk": (pk, pk + 2 * ROWS * PLANE64),
             "pq": (pq, pq + 2 * ROWS * PLANE64)}
    for name, (a, b) in parts.items():
        at[name] = (r0 + 2 * a, r0 + 2 * b)
        assert at[name][1] <= r1 and at[name][0] % 16 == 0, name
    return at, used


# The kernel's phases (barriers between; block_sum's inside the third): what each reads and writes.
PHASES = [
    ("the loads before Info", set(), {"S", "H", "v_hi", "Y_dv", "info"}),  # v_new's and dv_new's bfloat16 rows
    ("dgamma, dw", {"H", "S", "Y_dv", "info"}, {"scratch"}),
    ("the norms, dq_state, dPL", {"q", "k", "Y_do", "H", "v_hi", "info"}, {"rq", "rk", "DQ", "Z"}),
    ("dk_tilde, dPL's planes", {"v_hi", "S", "Z", "rq", "rk"}, {"DKT", "pk", "pq"}),
    ("Z, the E and Kt terms", {"q", "k", "rq", "rk", "Z", "DQ", "DKT", "info"}, {"Z", "dG", "t"}),
    ("the L term, q's gradient, k's part", {"Z", "dG", "pk", "k", "pq", "q", "DKT", "info"}, {"dG", "DQ"}),
    ("the norm's backward (q's gradient in place), dg_part", {"q", "rq", "DQ", "dG", "t", "info"}, {"DQ"}),
    ("the cluster's sum over the value heads", {"DQ", "info"}, set()),  # (and the other blocks' DQ)
]
EARLY = 2  # the phases before q's, k's and d_o's rows (issued after Info) are waited for


def check_phases(at) -> None:
    """Each phase's writes against its reads and writes; each read against the writes between it and its
    writer. q's, k's and d_o's rows, copied while phases 1 and 2 run, are checked against theirs."""
    in_flight = {"q", "k", "Y_do"}
    for name, reads, writes in PHASES[:EARLY]:
        for x in in_flight:
            for y in reads | writes:
                assert not (at[x][0] < at[y][1] and at[y][0] < at[x][1]), f"{x} in flight over {y} ({name})"
    phases = PHASES[:EARLY] + [("q's, k's and d_o's rows land", set(), in_flight)] + PHASES[EARLY:]
    over = lambda a, b: at[a][0] < at[b][1] and at[b][0] < at[a][1]  # noqa: E731
    for i, (name, reads, writes) in enumerate(phases):
        for w in writes:
            for x in reads | writes:
                assert x == w or not over(w, x), f"{name}: {w} overlaps {x}"
        for r in reads:
            last = max((j for j in range(i) if r in phases[j][2]), default=None)
            assert last is not None, f"{name}: {r} read before written"
            for j in range(last + 1, i):
                for w in phases[j][2]:
                    assert w == r or not over(w, r), f"{name}: {r} ({phases[last][0]}) overwritten by {w} ({phases[j][0]})"


def plane_gemm(nt, m, n, k, tri):
    """plane_gemm's dealing: each epilogue call's (warp, lane, row, column of the pair) and each tile's k-steps."""
    def next_tile(tile, warp):
        if tri == NONE:
            return tile + WARPS
        return tile + 2 * (WARPS - warp) - 1 if tile // WARPS % 2 == 0 else tile + 2 * warp + 1

    def skip(m0, n0, k0):
        n1, k1 = n0 + 8 * nt, k0 + 16
        return ((tri & LOWER_A) and k0 >= m0 + 16 and k1 <= ROWS) or ((tri & UPPER_A) and k1 <= m0 < ROWS) or \
               ((tri & UPPER_B) and k0 >= n1) or ((tri & LOWER_C) and n0 >= m0 + 16)
    calls, steps, groups = [], {}, n // (8 * nt)
    for warp in range(WARPS):
        tile = warp
        while tile < m // 16 * groups:
            row, col = tile // groups, tile % groups
            col = (col + groups - row % groups) % groups if tri == LOWER_C else col
            m0, n0 = row * 16, col * 8 * nt
            steps[(m0, n0)] = [k0 for k0 in range(0, k, 16) if not skip(m0, n0, k0)]
            calls += [(warp, lane, m0 + lane // 4 + e * 8, n0 + 8 * j + 2 * (lane % 4))
                      for lane in range(32) for j in range(nt) for e in range(2)]
            tile = next_tile(tile, warp)
    return calls, steps


PRODUCTS = {  # (NT, M, N, K, Tri) of each plane_gemm call, every epilogue taking pairs
    "dw (dv_new h^T)": (4, 64, 128, 128, NONE),
    "dq_state (d_o h^T)": (4, 64, 128, 128, NONE),
    "dPL (d_o v_new^T)": (2, 64, 64, 128, LOWER_C),
    "dk_tilde (v_new d_state^T)": (4, 64, 128, 128, NONE),
    "Q K^T": (2, 64, 64, 128, NONE),
    "q's gradient (dPL diag(r_k) k)": (4, 64, 128, 64, LOWER_A),
    "k's part ((diag(r_q s) dPL)^T q)": (4, 64, 128, 64, UPPER_A),
}


def check_products():
    out = {}
    for name, (nt, m, n, k, tri) in PRODUCTS.items():
        calls, steps = plane_gemm(nt, m, n, k, tri)
        seen = collections.Counter((r, c) for _, _, r, c in calls)
        assert seen == collections.Counter({(r, c): 1 for r in range(m) for c in range(0, n, 2)}), name
        every = set(range(0, k, 16))
        for (m0, n0), ks in steps.items():  # a skipped step's terms are zeros of the triangular operand
            dropped = every - set(ks)
            if tri == LOWER_A:  # dPL's (r, j), j > r: row tile m0's steps from m0 + 16
                assert dropped <= {k0 for k0 in every if k0 >= m0 + 16}, name
            elif tri == UPPER_A:  # dPL^T's (r, j), j < r
                assert dropped <= {k0 for k0 in every if k0 + 16 <= m0}, name
            elif tri == LOWER_C:  # a tile wholly above the diagonal: the epilogue writes its zeros
                assert not dropped or n0 >= m0 + 16, name
            else:
                assert not dropped, name
        out[name] = calls
    return out


def check_rows() -> None:
    """The loops a warp or a thread a row: q's norm backward and e_kt_terms (row warp + 16 j), the
    antisymmetric row sum (row tid / 8, its first thread writes), split_dpl's pairs."""
    rows = collections.Counter(w + j * WARPS for w in range(WARPS) for j in range(ROWS // WARPS))
    assert rows == collections.Counter({i: 1 for i in range(ROWS)})
    first = collections.Counter(tid // ROW_THREADS for tid in range(THREADS) if tid % ROW_THREADS == 0)
    assert first == collections.Counter({i: 1 for i in range(ROWS)})
    pairs = collections.Counter((tid // 32 + u * (2 * THREADS // ROWS), tid % 32 * 2) for tid in range(THREADS)
                                for u in range(ROWS * ROWS // 2 // THREADS))
    assert pairs == collections.Counter({(r, c): 1 for r in range(ROWS) for c in range(0, ROWS, 2)})


def epilogue_wavefronts(calls, pitch_bytes):
    """The most wavefronts of a warp's 8-byte epilogue access (pairs) into a float32 tile."""
    by = collections.defaultdict(list)
    for warp, lane, r, c in calls:
        by[(warp, r - lane // 4, c - 2 * (lane % 4))].append((lane, r * pitch_bytes + c * 4))
    return max(wavefronts([a for _, a in sorted(v)], 8) for v in by.values())


def main() -> int:
    at, size = carve()
    assert size <= MAX_SMEM, size
    check_phases(at)
    try:  # pk moved 64 elements back, over dk_tilde's last row: the check must fail
        check_phases(carve(pk_offset=-64)[0])
    except AssertionError:
        pass
    else:
        raise AssertionError("a region over a live one passed")
    calls = check_products()
    check_rows()
    print(f"DqkwgSmem: {size} bytes a block ({size / 1024:.1f} KB of {MAX_SMEM // 1024}): one block a multiprocessor")
    for name, (a, b) in sorted(at.items(), key=lambda x: x[1]):
        print(f"  {name:10s} [{a:6d}, {b:6d})  {b - a:6d} B")
    print("phases: no region written over another live in its phase; every read finds its writer's bytes")
    print("products: every element of C to its epilogue once, only zero k-steps skipped; every row and pair once")
    hot = {"dq_state's pairs into DQ": (calls["dq_state (d_o h^T)"], LDF * 4),
           "dk_tilde's pairs into DKT": (calls["dk_tilde (v_new d_state^T)"], LDF * 4),
           "q's gradient's pairs added to DQ": (calls["q's gradient (dPL diag(r_k) k)"], LDF * 4),
           "dk_tilde's pairs read in k's part's epilogue": (calls["k's part ((diag(r_q s) dPL)^T q)"], LDF * 4),
           "dPL's pairs into Z (pitch 68, as intra_dpl)": (calls["dPL (d_o v_new^T)"], PITCH64 * 4)}
    print("wavefronts a warp access (8 bytes a lane: 2 is conflict free):")
    for name, (c, pitch) in hot.items():
        print(f"  {name}: {epilogue_wavefronts(c, pitch)}")
    assert all(epilogue_wavefronts(c, p) == 2 for n, (c, p) in hot.items() if "Z" not in n)
    row = [5 * LDF * 4 + lane * 4 for lane in range(32)]
    print(f"  e_kt_terms' row reads of DQ and dk_tilde (4 bytes a lane): {wavefronts(row, 4)}")
    print(f"  split_dpl's pairs of dPL: {wavefronts([lane * 8 for lane in range(32)], 8)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
