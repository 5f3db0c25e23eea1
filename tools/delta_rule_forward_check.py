"""A CPU check of the forward's plane kernels' hand-offs and carve (cc/ops/gated_delta_rule.cu):

- recurrence_planes_kernel (both instances) reads each chunk's base a step ahead into registers:
  over over_chunks' order of calls (ahead, load, then per step turn, load of the next chunk, ahead of
  the one after, step), step i must take chunk i's tiles, decay and base, and the folded backward's
  (reverse, kFold) its d_o rows by the token that ahead() read for that chunk, for any number of
  chunks;
- output_planes_kernel copies q's and k's raw rows and the first pass's h before load_info
  (ChunkBlock's early): its carve (OutputPlanesSmem, mirrored below: change both together) fits two
  blocks a multiprocessor, no region in flight or written in a phase overlaps another that phase reads
  or writes, each pass's B rows 0..191 (v_new's, bfloat16 as the recurrence stored it, then h's) find
  the bytes their copies left, and every element of h's rows is copied once, where plane_gemm reads it.

- local_grads_planes_kernel (the backward's) copies q's, k's and d_o's raw rows before load_info: its
  carve (LocalPlanesSmem, mirrored below) fits two blocks a multiprocessor, the three copies in
  flight overlap nothing live, every read finds its writer's bytes, each row lands once where its
  reader takes it (d_o's where plane_gemm reads B), and padding slots' rows are zero (the zero fill).

The two carves are mirrored here and checked against the .cu's own structs, cut from it and
compiled by g++ (where there is one), so an edit of the kernel's carve alone fails too. A hand-off
a step late, a carve with q's rows over h's and one with d_o's rows over k's are checked to fail,
so the check can.

    python3 tools/delta_rule_forward_check.py
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

ROWS, THREADS, PK, DV = 64, 512, 128, 128
PLANE_ROW = 136  # kPlaneRow
OUT_COLS, PITCH = 64, 72  # OutputPlanesSmem::kOutCols, kPitch
SM_SMEM, RESERVED = 228 * 1024, 1024  # an sm_90 multiprocessor's shared memory; the system's share a block


def recurrence_steps(chunks: int, reverse: bool = False, late: bool = False) -> list[tuple[int, ...]]:
    """over_chunks' calls as the kernel makes them: what each step takes, (chunk, its stage's tiles,
    decay, base, d_o's token's chunk), all the chunk's own. reverse: the folded backward's order (last
    chunk first; ahead() reads the slot token load() takes next). late: turn() after the next load
    (the mutation delta_rule_recurrence_base_a_step_late)."""
    offset = [10 * i for i in range(chunks)]  # chunk_at's p.offset (documents: + doc)
    reg = {"next_base": None, "base": None, "tok": None}
    stages: list[dict] = [{}, {}]

    def chunk_at(i: int) -> int:
        return offset[chunks - 1 - i if reverse else i] if i < chunks else 0

    def ahead(chunk: int) -> None:
        reg["tok"] = chunk  # p.slots[chunk * 64 + ...]

    def load(stage: int, chunk: int) -> None:
        stages[stage] = {"tiles": chunk, "tok": reg["tok"]}  # cp.async: a, b (eq, d_o by tok)
        reg["next_base"] = chunk  # registers, a step ahead

    def turn() -> None:
        reg["base"] = reg["next_base"]

    taken = []
    chunk, nxt = chunk_at(0), chunk_at(1)
    if chunks > 0:
        ahead(chunk)
        load(0, chunk)
    if chunks > 1:
        ahead(nxt)
    for i in range(chunks):
        after, stage = chunk_at(i + 2), i % 2
        dec = chunk  # over_chunks' p.decay[head], read at the step's start
        if not late:
            turn()
        if i + 1 < chunks:
            load(1 - stage, nxt)
        if late:
            turn()
        if i + 2 < chunks:
            ahead(after)
        taken.append((chunk, stages[stage]["tiles"], dec, reg["base"], stages[stage]["tok"]))
        chunk, nxt = nxt, after
    return taken


def check_recurrence(**mutation: bool) -> None:
    for reverse in (False, True):
        for chunks in range(7):
            got = recurrence_steps(chunks, reverse, **mutation)
            order = [10 * (chunks - 1 - i if reverse else i) for i in range(chunks)]
            assert got == [(c,) * 5 for c in order], (reverse, chunks, got)


INFO = 64 * 8 + 64 * 8 + 3 * 64 * 4 + 4  # Info's bytes (sizeof pads it to 1,800; the next take aligns either way)
LDQP = ROWS + PK + 8  # QP's pitch (floats)


def carve(takes: list[tuple[str, int]]) -> tuple[dict[str, tuple[int, int]], int]:
    """Carve::take's regions (byte ranges), each on 16 bytes, and the bytes used."""
    at, used = {}, 0
    for name, n in takes:
        used = (used + 15) // 16 * 16
        at[name] = (used, used + n)
        used += n
    return at, used


def assert_in_x(at, names) -> None:
    for name in names:
        assert at["X"][0] <= at[name][0] and at[name][1] <= at["X"][1] and at[name][0] % 16 == 0, name


def output_carve(rows_at_hi: bool = True) -> tuple[dict[str, tuple[int, int]], int]:
    """OutputPlanesSmem's regions (byte ranges) and its size (Carve::take's order and 16-byte
    alignment). rows_at_hi=False: q's and k's rows at X's start (over h's rows: must fail)."""
    k_hi = (ROWS + 128) * PITCH // 2  # floats
    at, used = carve([("info", INFO), ("QP", ROWS * LDQP * 4),
                      ("X", 4 * max(k_hi + ROWS * PLANE_ROW, (ROWS + PK + ROWS) * PITCH // 2))])
    x = at["X"][0]
    rows = x + (4 * k_hi if rows_at_hi else 0)
    bf = 2  # bytes a bfloat16
    at["q"] = (rows, rows + ROWS * PLANE_ROW * bf)
    at["k"] = (at["q"][1], at["q"][1] + ROWS * PLANE_ROW * bf)
    at["rn"] = (x, x + 2 * ROWS * 4)
    at["v_hi"] = (x, x + ROWS * PITCH * bf)
    at["h"] = (at["v_hi"][1], at["v_hi"][1] + PK * PITCH * bf)
    lo = x + (ROWS + PK) * PITCH * bf  # kLo
    at["v_lo"] = (lo, lo + ROWS * PITCH * bf)
    assert_in_x(at, ("q", "k", "rn", "v_hi", "h", "v_lo"))
    return at, used


# The output kernel's phases (barriers between), with the copies in flight across them: what each reads
# and writes. The early copies (h of pass 0, q, k) land at build_qp_planes' wait.
OUT_EARLY = {"h", "q", "k"}
OUT_PHASES = [
    ("load_info", {"info"}, {"info"}),
    ("the norms (E Q, rn)", {"q", "k", "info"}, {"QP", "rn"}),
    ("Q K^T", {"q", "k", "rn", "info"}, {"QP"}),
    ("split in place, pass 0's v_new copied", {"QP"}, {"QP", "v_hi"}),  # (v_new bfloat16: no lo plane)
    ("pass 0's product", {"QP", "v_hi", "h", "info"}, set()),
    ("pass 1's loads", set(), {"v_hi", "h"}),
    ("pass 1's product", {"QP", "v_hi", "h", "info"}, set()),
]


def check_phases(at, early, phases) -> None:
    over = lambda a, b: at[a][0] < at[b][1] and at[b][0] < at[a][1]  # noqa: E731
    for name, reads, writes in phases[:1]:  # the early copies in flight during load_info
        for x in early:
            for y in reads | writes:
                assert not over(x, y), f"{x} in flight over {y} ({name})"
    assert not any(over(a, b) for a in early for b in early if a != b), "the early copies overlap"
    last = {x: "early" for x in early} | {"info": "load_info"}
    for name, reads, writes in phases:
        for w in writes:
            for x in reads | writes:
                assert x == w or not over(w, x), f"{name}: {w} overlaps {x}"
        for r in reads:
            assert r in last, f"{name} reads {r} before any writer"
        for w in writes:
            for r in list(last):
                if r != w and over(w, r):
                    del last[r]
            last[w] = name


def check_output_h_rows(at) -> None:
    """copy_rows<64>'s pieces of the first pass's h (early) and plane_gemm's B rows 64..191: every
    element h[k][n] (n < 64) lands once at B's (64 + k, n), inside the h region."""
    per, pieces = 8, OUT_COLS // 8
    step = THREADS // pieces
    landed = {}
    for tid in range(THREADS):
        r0, c = tid // pieces, tid % pieces * per
        for p0 in range(0, PK, step):
            for j in range(per):
                dst = at["X"][0] + 2 * ((ROWS + p0 + r0) * PITCH + c + j)  # x + kRows * kPitch, pitch kPitch
                src = (p0 + r0, c + j)
                assert src not in landed, src
                landed[src] = dst
    for k in range(PK):
        for n in range(OUT_COLS):
            b = at["X"][0] + 2 * ((ROWS + k) * PITCH + n)  # plane_gemm's B (kTB false): (k, n) at k * ldb + n
            assert landed[(k, n)] == b and at["h"][0] <= b < at["h"][1], (k, n)


def local_carve(do_rows: int = 2) -> tuple[dict[str, tuple[int, int]], int]:
    """LocalPlanesSmem's regions (byte ranges) and size. do_rows: d_o's rows after that many of X's
    64-row blocks (kDo = 2 * kRows * kPlaneRow; 1: over k's rows, must fail)."""
    at, used = carve([("info", INFO), ("QP", ROWS * LDQP * 4), ("X", 3 * ROWS * PLANE_ROW * 2), ("rn", 2 * ROWS * 4)])
    block = ROWS * PLANE_ROW * 2
    x = at["X"][0]
    at["q"], at["k"] = (x, x + block), (x + block, x + 2 * block)
    at["d_o"] = (x + do_rows * block, x + (do_rows + 1) * block)
    assert_in_x(at, ("q", "k", "d_o"))
    return at, used


# local_grads_planes' phases: the early copies (q, k, d_o) land at build_qp_planes' wait.
LOCAL_EARLY = {"q", "k", "d_o"}
LOCAL_PHASES = [
    ("load_info", {"info"}, {"info"}),
    ("the norms (E Q, rn)", {"q", "k", "info"}, {"QP", "rn"}),
    ("Q K^T", {"q", "k", "rn", "info"}, {"QP"}),
    ("split in place", {"QP"}, {"QP"}),
    ("E Q out, P^T d_o", {"QP", "d_o"}, set()),
]


def check_local_rows(at, T: int = 40) -> None:
    """load_rows_early<true>'s pieces (thread i0 = tid / 16 rows i0 and + 32, 8 values from c = tid %
    16 * 8) for q, k and d_o: element (i, n) of each lands once at its region's i * kPlaneRow + n, where
    build_qp_planes (q, k) and plane_gemm (B = d_o, kTB false: (k, n) at k * ldb + n) read it; padding
    slots (token >= T) copy nothing and land zeros (the zero fill's src-size 0)."""
    slots = [5 * i if 5 * i < T else T + 3 for i in range(ROWS)]  # tokens; padding past T
    pieces, passes = 16, ROWS * 16 // THREADS
    for name in ("q", "k", "d_o"):
        landed = {}
        for tid in range(THREADS):
            i0, c = tid // pieces, tid % pieces * 8
            for u in range(passes):
                i = i0 + u * (THREADS // pieces)
                tok = slots[i]
                in_doc = tok < T
                for j in range(8):
                    dst = at[name][0] + 2 * (i * PLANE_ROW + c + j)
                    assert dst not in landed, (name, i, c + j)
                    landed[dst] = (tok, c + j) if in_doc else 0  # (the source: token's row, column), or zero
        for i in range(ROWS):
            for n in range(128):
                got = landed[at[name][0] + 2 * (i * PLANE_ROW + n)]
                assert got == ((slots[i], n) if slots[i] < T else 0), (name, i, n, got)


CU = Path(__file__).resolve().parent.parent / "cc" / "ops" / "gated_delta_rule.cu"


def _cut(src: str, start: str) -> str:
    """The text of the .cu from the line starting `start` to the end of its statement (a struct: its
    closing brace at depth 0 and the semicolon)."""
    i = src.index("\n" + start) + 1
    if not start.startswith("struct"):
        return src[i:src.index("\n", i)]
    depth, j = 0, src.index("{", i)
    while True:
        depth += {"{": 1, "}": -1}.get(src[j], 0)
        j += 1
        if depth == 0:
            return src[i:src.index(";", j) + 1]


def cuda_carves() -> dict[str, dict[str, int]] | None:
    """The two carves as the .cu's own structs lay them out: those structs and the constants they use,
    cut from cc/ops/gated_delta_rule.cu and compiled for the host by g++ (the mirrors above are checked
    against them, so an edit of either alone fails). None where there is no g++."""
    gxx = shutil.which("g++")
    if gxx is None:
        return None
    src = CU.read_text()
    cut = [_cut(src, s) for s in ("constexpr int kThreads", "__host__ __device__ constexpr int round16",
                                  "__host__ __device__ constexpr int larger", "struct Carve", "struct Info",
                                  "struct Dims", "constexpr int kPlaneRow", "struct OutputPlanesSmem",
                                  "struct LocalPlanesSmem")]
    text = "\n".join([
        "#include <cstdint>", "#include <cstddef>", "#include <cstdio>", "#define __host__", "#define __device__",
        "using __nv_bfloat16 = uint16_t;", "constexpr int64_t kChunk = 64;  // (gated_delta_rule.h)", *cut,
        "struct D128 { int dk = 128, dv = 128, pk = 128, pv = 128; };",
        "alignas(16) static unsigned char base[1 << 20];",
        "#define AT(k, x) printf(\"%s %s %ld\\n\", #k, #x, (long)((unsigned char*)m.x - base))",
        "int main() {",
        "  { Carve c{base}; OutputPlanesSmem m(c, D128{}); AT(output, info); AT(output, QP); AT(output, X);",
        "    AT(output, rows); AT(output, rn); printf(\"output size %ld\\n\", (long)c.used); }",
        "  { Carve c{base}; LocalPlanesSmem m(c, D128{}); AT(local, info); AT(local, QP); AT(local, X); AT(local, rn);",
        "    printf(\"local size %ld\\nlocal d_o %ld\\n\", (long)c.used, (long)((unsigned char*)((uint16_t*)m.X + LocalPlanesSmem::kDo) - base)); }",
        "}"])
    with tempfile.TemporaryDirectory() as d:
        cc, exe = Path(d) / "carve.cc", Path(d) / "carve"
        cc.write_text(text)
        subprocess.run([gxx, "-std=c++17", "-o", str(exe), str(cc)], check=True, capture_output=True)
        out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    got: dict[str, dict[str, int]] = {}
    for line in out.splitlines():
        kernel, name, value = line.split()
        got.setdefault(kernel, {})[name] = int(value)
    return got


def check_against_cuda(carves) -> None:
    """The mirrors' regions start where the .cu's structs put them, and their sizes agree."""
    at, size = output_carve()
    want = {"info": at["info"][0], "QP": at["QP"][0], "X": at["X"][0], "rows": at["q"][0], "rn": at["rn"][0],
            "size": size}
    assert carves["output"] == want, (carves["output"], want)
    at, size = local_carve()
    want = {"info": at["info"][0], "QP": at["QP"][0], "X": at["X"][0], "rn": at["rn"][0], "size": size,
            "d_o": at["d_o"][0]}
    assert carves["local"] == want, (carves["local"], want)


def main() -> int:
    carves = cuda_carves()
    if carves is not None:
        check_against_cuda(carves)
        print("the mirrored carves equal the .cu's structs (compiled by g++)")
    check_recurrence()
    try:
        check_recurrence(late=True)
    except AssertionError:
        pass
    else:
        raise AssertionError("the base handed over a step late passed")
    at, size = output_carve()
    assert 2 * (size + RESERVED) <= SM_SMEM, size
    check_phases(at, OUT_EARLY, OUT_PHASES)
    check_output_h_rows(at)
    try:  # q's and k's rows at X's start, over h's in flight: the check must fail
        check_phases(output_carve(rows_at_hi=False)[0], OUT_EARLY, OUT_PHASES)
    except AssertionError:
        pass
    else:
        raise AssertionError("a region over a live one passed")
    at_l, size_l = local_carve()
    assert 2 * (size_l + RESERVED) <= SM_SMEM, size_l
    check_phases(at_l, LOCAL_EARLY, LOCAL_PHASES)
    check_local_rows(at_l)
    try:  # d_o's rows over k's, both in flight: the check must fail
        check_phases(local_carve(do_rows=1)[0], LOCAL_EARLY, LOCAL_PHASES)
    except AssertionError:
        pass
    else:
        raise AssertionError("d_o's rows over k's passed")
    print("recurrence_planes (forward, folded reverse): step i takes its chunk's tiles, decay, base and d_o "
          "token (0 to 6 chunks)")
    print(f"OutputPlanesSmem: {size} bytes a block, two a multiprocessor ({2 * (size + RESERVED)} of {SM_SMEM})")
    for name, (a, b) in sorted(at.items(), key=lambda x: x[1]):
        print(f"  {name:6s} [{a:6d}, {b:6d})  {b - a:6d} B")
    print("phases: the early copies overlap nothing live before they land; every read finds its writer's bytes")
    print(f"LocalPlanesSmem: {size_l} bytes a block, two a multiprocessor ({2 * (size_l + RESERVED)} of {SM_SMEM})")
    for name, (a, b) in sorted(at_l.items(), key=lambda x: x[1]):
        print(f"  {name:6s} [{a:6d}, {b:6d})  {b - a:6d} B")
    print("local_grads: q's, k's and d_o's rows land once where read, padding rows zero")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
