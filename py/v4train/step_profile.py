"""One training step under torch.profiler (--profile_step): its wall time split into compute and
communication, and a Chrome trace of it.

Communication is the collectives: on the GPU the NCCL kernels, on the CPU (gloo) the collective
ops (gloo's transfers on its own threads, the waits on the calling thread). Both are measured in
lanes that run side by side, the GPU's streams or the CPU's threads (FSDP2 prefetches the next
layer's weights on a stream of its own; gloo transfers while the main thread computes). Time is the
union of the events' intervals, so that nested ops and concurrent lanes count once:
- communication_s: the union of the collectives, in every lane;
- compute_s: the union, over the lanes, of a lane's other events less its collectives (a CPU op
  that waits for an exchange inside, the MoE layer's all-to-all, computes only outside it);
- exposed_communication_s: communication while no lane computes (what more overlap could save);
- other_s: the step's wall time when neither runs (the host launching or waiting, Python).
"""

from __future__ import annotations

import collections
import re
import time

import torch

# Collective ops of c10d, its functional collectives (the MoE exchange from C++), gloo's and NCCL's
# own names, and the kernels NCCL launches (ncclDevKernel_*, ncclKernel_*).
COLLECTIVE = re.compile(r"^(c10d::|_c10d_functional::|c10d_functional::|gloo:|nccl|record_param_comms)")

Intervals = list[tuple[float, float]]  # disjoint, in order (as union makes them)


def union(intervals: list[tuple[float, float]]) -> Intervals:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """The parts of a outside b."""
    out, j = [], 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, at = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > at:
                out.append((at, b[k][0]))
            at = max(at, b[k][1])
            k += 1
        if at < end:
            out.append((at, end))
    return out


def length(intervals: Intervals) -> float:
    return sum(b - a for a, b in intervals)


def split(events: list[tuple[str, object, float, float]], step_s: float) -> dict[str, float]:
    """The step's time split (module docstring) from its events (name, lane, start_us, end_us)."""
    lanes = collections.defaultdict(lambda: ([], []))  # lane -> (other events, collectives)
    for name, lane, start, end in events:
        lanes[lane][bool(COLLECTIVE.match(name))].append((start, end))
    comm = union([i for _, collectives in lanes.values() for i in collectives])
    compute = union([i for other, collectives in lanes.values() for i in subtract(union(other), union(collectives))])
    us = 1e-6
    return {"step_s": step_s, "compute_s": length(compute) * us, "communication_s": length(comm) * us,
            "exposed_communication_s": length(subtract(comm, compute)) * us,
            "other_s": max(0.0, step_s - length(union(comm + compute)) * us)}


class Profiled:
    """`with Profiled(device, trace_path) as p:` one step; then p.split (above) and the trace
    written to trace_path (chrome://tracing, Perfetto)."""

    def __init__(self, device: str, trace_path: str):
        self.device, self.trace_path, self.split = device, trace_path, None

    def __enter__(self) -> "Profiled":
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
        self.profile = profile(activities=activities)
        self.profile.__enter__()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
        step_s = time.perf_counter() - self.t0
        self.profile.__exit__(*exc)
        if exc[0] is not None:
            return
        # The GPU's kernels by stream, or the CPU's ops by thread (not the profiler's own span).
        cuda = self.device == "cuda"
        kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
        events = [(e.name, e.device_resource_id if cuda else e.thread, e.time_range.start, e.time_range.end)
                  for e in self.profile.events() if e.device_type == kind and not e.name.startswith("PyTorch Profiler")]
        self.split = split(events, step_s)
        self.profile.export_chrome_trace(self.trace_path)
