"""Times each op's C++ entry against its reference: forward, forward+backward, peak memory.

    PYTHONPATH=py:build/ext:. python3 tools/benchmark.py [--device cuda] [--dtype bfloat16]

Shapes are those of the models' hot paths (GLM-5: 4096 tokens x hidden 6144). Prints one
markdown table row per op and implementation; docs/benchmarks.md records what it printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from v4train.ops import OPS


def rms_norm_case(device, dtype):
    x = torch.randn(4096, 6144, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(6144, device=device, dtype=dtype, requires_grad=True)
    return "x [4096, 6144], weight [6144]", (x, w, 1e-6, False)


def _param_set(device, dtype):
    """The rank-16 LoRA tensors of one GLM-5 MoE layer: its five attention projections and its
    256 routed experts (gate_up and down): 14 tensors, 77M values."""
    gen = torch.Generator().manual_seed(0)
    r = 16
    attention = [(r, 6144), (2048, r), (r, 2048), (64 * 256, r), (r, 6144), (576, r), (r, 512), (64 * 448, r),
                 (r, 64 * 256), (6144, r)]
    shapes = attention + [(256, r, 6144), (256, 4096, r), (256, r, 2048), (256, 6144, r)]
    return [torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in shapes]


def adam_step_case(device, dtype):
    params, grads = _param_set(device, dtype), _param_set(device, dtype)
    moments = [[torch.zeros_like(p, dtype=torch.float32) for p in params] for _ in range(2)]
    n = sum(p.numel() for p in params)
    return f"{len(params)} tensors, {n / 1e6:.0f}M values", (params, grads, *moments, 1, 1e-4, 0.9, 0.999, 1e-8, 0.0)


def clip_grad_norm_case(device, dtype):
    grads = _param_set(device, dtype)
    return f"{len(grads)} tensors, {sum(g.numel() for g in grads) / 1e6:.0f}M values", (grads, 1.0)


def cross_entropy_loss_case(device, dtype, tokens=16384):
    """GLM-5's LM head over a 16k-token batch: the reference keeps every chunk's logits."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, 6144, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    w = (0.02 * torch.randn(154880, 6144, generator=gen)).to(device=device, dtype=dtype).requires_grad_()
    t = torch.randint(0, 154880, (tokens,), generator=gen).to(device)
    return f"hidden [{tokens}, 6144], lm_head [154880, 6144], chunks of 4096", (h, w, t, float(tokens), 4096)


CASES = {"v4_rms_norm": rms_norm_case, "v4_cross_entropy_loss": cross_entropy_loss_case, "v4_adam_step": adam_step_case, "v4_clip_grad_norm": clip_grad_norm_case}


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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--ops", default="", help="comma list of ops to time (default: all)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}, dtype {args.dtype}, median of {args.reps}")
    print("| op | shape | impl | forward ms | fwd+bwd ms | peak MiB (fwd+bwd) |")
    print("|---|---|---|---|---|---|")
    for op_name, case in CASES.items():
        if args.ops and op_name not in args.ops.split(","):
            continue
        op = OPS[op_name]
        shape, op_args = case(args.device, dtype)
        for impl, fn in (("reference", op.reference), ("cpp", op.cpp())):
            if op.inplace:  # an optimizer op: no backward
                ms = timed(lambda: fn(*op_args), args.device, args.reps)
                print(f"| {op_name} | {shape} | {impl} | {ms:.3f} | - | - |", flush=True)
                continue
            grad = torch.randn_like(fn(*op_args))

            def fwd():
                with torch.no_grad():
                    fn(*op_args)

            def fwd_bwd():
                fn(*op_args).backward(grad)

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
            print(f"| {op_name} | {shape} | {impl} | {fwd_ms:.3f} | {fb_ms:.3f} | {peak} |", flush=True)


if __name__ == "__main__":
    main()
