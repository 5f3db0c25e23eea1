"""Times each op's C++ entry against its reference: forward, forward+backward, peak memory.

    PYTHONPATH=py:build/ext:. python3 tools/benchmark.py [--device cuda] [--dtype bfloat16] [--ops v4_a,v4_b] [--profile]
        [--cases 1] [--once]

The cases are the `benchmarks` of each op's test case (py/v4train/testing/cases/<op>.py), at the shapes of the
models' hot paths (GLM-5: 4096 tokens x hidden 6144). Prints one markdown table row per case and
implementation; docs/benchmarks.md records what it printed. `--impl ...,fla` adds the op's peer from
flash-linear-attention where it has one and fla is installed (v4_gated_delta_rule: issue 18's anchor,
timed in the same process on the same inputs).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from v4train.ops import REFERENCE
from v4train.testing.cases import CASES


def first(out):
    """An op's differentiable output: the tensor, or the first of a tuple (v4_mla_dsa_attention also
    returns its layer's key selection)."""
    return out[0] if isinstance(out, tuple) else out


def timed(fn, device, reps):
    """Median milliseconds of fn() over reps calls, after warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def profile(fn, device, top=12):
    """Where one call of fn() spends its time: the `top` kernels (or CPU ops) by total time, with counts."""
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, key) > 0]
    total = sum(getattr(e, key) for e in events)
    for e in sorted(events, key=lambda e: -getattr(e, key))[:top]:
        print(f"    {getattr(e, key) / 1e3:8.3f} ms {100 * getattr(e, key) / total:5.1f}% x{e.count:<5d} {e.key[:110]}")
    if device == "cuda":  # (the rows above count a kernel twice: itself, and in the op or function that launched it)
        spans = [e.time_range.elapsed_us() for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        print(f"    {sum(spans) / 1e3:8.3f} ms on the device: all {len(spans)} kernels, copies and fills, once each")


def host_profile(fn, top=8):
    """Where a CUDA call's wall time goes beside its kernels: when its first kernel starts and its last
    ends, from the call's start, against the kernels' own time; and the host's `top` ops by their own
    CPU time (a read back that waits on the device shows as the op that reads)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    if not host or not kernels:
        return
    start = min(e.time_range.start for e in host)
    first, last = min(k.time_range.start for k in kernels), max(k.time_range.end for k in kernels)
    busy = sum(k.time_range.elapsed_us() for k in kernels)
    print(f"    forward: the first kernel {(first - start) / 1e3:.3f} ms after the call's start, the last done at "
          f"{(last - start) / 1e3:.3f} ms; the device busy {busy / 1e3:.3f} ms of that")
    ops = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"    {e.self_cpu_time_total / 1e3:8.3f} ms host x{e.count:<5d} {e.key[:110]}")


def fla_gated_delta_rule(unchecked: bool):
    """(row name, fn): flash-linear-attention's chunk_gated_delta_rule on v4_gated_delta_rule's arguments
    (q and k L2-normalised in its kernel, scale 1/sqrt(K), one packed batch); None where fla is not
    installed. fla refuses its gated backward on Hopper with Triton 3.4 to 3.7.0, which compiles it to
    wrong gradients (fla issue 640); `unchecked` lifts the refusal for its times alone, and the row says so."""
    try:
        import fla.ops.common.chunk_o as chunk_o
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    name = "fla"
    # (The refusal's flag is remembered as found: a second case must name its row as the first did.)
    if unchecked and getattr(chunk_o, "v4train_refused", not chunk_o.TRITON_ABOVE_3_7_1):
        chunk_o.v4train_refused, chunk_o.TRITON_ABOVE_3_7_1 = True, True
        name = "fla (times only: its gradients are wrong on this Triton)"

    on_device = {}  # fla's kernels read cu_seqlens on the device: each case's copy made once, untimed

    def call(q, k, v, g, beta, cu_seqlens):
        if id(cu_seqlens) not in on_device:
            on_device[id(cu_seqlens)] = cu_seqlens.to(q.device)
        o, _ = chunk_gated_delta_rule(q[None], k[None], v[None], g[None].float(), beta[None],
                                      cu_seqlens=on_device[id(cu_seqlens)], use_qk_l2norm_in_kernel=True)
        return o[0]

    return name, call


PEERS = {"v4_gated_delta_rule": fla_gated_delta_rule}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--ops", default="", help="comma list of ops to time (default: all)")
    parser.add_argument("--impl", default="reference,cpp",
                        help="which implementations to time: reference, cpp, fla (the op's peer, where it has one)")
    parser.add_argument("--fla_unchecked", action="store_true",
                        help="time fla where it refuses this Triton for wrong gradients (fla issue 640)")
    parser.add_argument("--profile", action="store_true", help="also print where a forward+backward spends its time "
                        "(on CUDA, and the forward's wall time beside its kernels)")
    parser.add_argument("--cases", default="", help="comma list of indices into each op's benchmark cases (default: all)")
    parser.add_argument("--once", action="store_true",
                        help="one forward+backward of each case, untimed, in-place ops left out: for a profiler to "
                             "attach to (ncu -k KERNEL -c 1)")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}, dtype {args.dtype}, median of {args.reps}")
    print("| op | shape | impl | forward ms | backward ms | fwd+bwd ms | peak MiB (fwd+bwd) |")
    print("|---|---|---|---|---|---|---|")
    picked = {int(i) for i in args.cases.split(",") if i}
    cases = [(name, case) for name, op in CASES.items() if op.has_cpp for i, case in enumerate(op.benchmarks)
             if (not args.ops or name in args.ops.split(",")) and (not picked or i in picked)]
    for op_name, case in cases:
        op = CASES[op_name]
        shape, op_args = case(args.device, dtype)
        impls = {"reference": lambda: REFERENCE[op_name], "cpp": op.cpp}
        for impl in args.impl.split(","):
            if impl == "fla":
                found = PEERS[op_name](args.fla_unchecked) if op_name in PEERS else None
                if found is None:
                    if op_name in PEERS:
                        print(f"| {op_name} | {shape} | fla | not installed | - | - | - |", flush=True)
                    continue
                impl, fn = found
            else:
                fn = impls[impl]()
            if op.inplace and args.once:
                continue
            if op.inplace:  # an optimizer op: no backward
                ms = timed(lambda: fn(*op_args), args.device, args.reps)
                print(f"| {op_name} | {shape} | {impl} | {ms:.3f} | - | - | - |", flush=True)
                continue
            grad = torch.randn_like(first(fn(*op_args)))

            def fwd():
                with torch.no_grad():
                    fn(*op_args)

            def fwd_bwd():
                first(fn(*op_args)).backward(grad)

            if args.once:
                fwd_bwd()
                if args.device == "cuda":
                    torch.cuda.synchronize()
                print(f"| {op_name} | {shape} | {impl} | once | once | once | - |", flush=True)
                continue
            fwd_ms = timed(fwd, args.device, args.reps)
            peak = ""
            if args.device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                fwd_bwd()
                torch.cuda.synchronize()
                peak = f"{(torch.cuda.max_memory_allocated() - base) / 2**20:.0f}"
            fb_ms = timed(fwd_bwd, args.device, args.reps)
            print(f"| {op_name} | {shape} | {impl} | {fwd_ms:.3f} | {fb_ms - fwd_ms:.3f} | {fb_ms:.3f} | {peak} |", flush=True)
            if args.profile:
                profile(fwd_bwd, args.device)
                if args.device == "cuda":
                    host_profile(fwd)


if __name__ == "__main__":
    main()
