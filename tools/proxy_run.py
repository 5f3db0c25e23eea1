"""A proxy of tools/bench_model.py trained by //py:train on one device and on N with expert
parallelism N, on the same global batch, side by side in one job (issue 20's NCCL run; on the CPU
with gloo as its dry run):

    python3 tools/proxy_run.py --model glm5 --gpus 2 --tokens 4096 --steps 8 --out build/multi_gpu_check

Writes the proxy's config.json and random token rows (one document of --tokens per row), runs
py/train.py with LoRA r=16 on attention and experts, C++ checkpointing, bf16: 1 process
accumulating N micro-batches, then N processes (--nproc_per_node=N --expert_parallel=N) one
each; reads their metrics.jsonl. Prints, and writes as JSON: tokens/s of both (the median step
after the first two) and their ratio, the largest per-step loss difference, rank 0's peak
memory against py/plan.py's prediction for each layout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import bench_model  # noqa: E402


def write_inputs(folder: str, model: str, rows: int, tokens: int, overrides: dict) -> tuple[str, str]:
    """(the proxy's config.json, a JSONL of `rows` random rows of `tokens` ids) in folder."""
    hf_cfg, _ = bench_model.PROXIES[model](**overrides)
    config = os.path.join(folder, "config.json")
    with open(config, "w") as f:
        json.dump(hf_cfg.to_dict(), f)
    data, gen = os.path.join(folder, "data.jsonl"), random.Random(0)
    with open(data, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"input_ids": [gen.randrange(hf_cfg.vocab_size) for _ in range(tokens)]}) + "\n")
    return config, data


def train(out: str, config: str, data: str, args, processes: int) -> list[dict]:
    """py/train.py's metrics rows for one layout (its log beside them)."""
    launch = [f"--nproc_per_node={processes}", f"--expert_parallel={processes}"] if processes > 1 else []
    command = [sys.executable, os.path.join(ROOT, "py", "train.py"), f"--model_config={config}", f"--data={data}",
               f"--output_dir={out}", "--overwrite_output_dir", f"--seq_len={args.tokens}", "--micro_batch_size=1",
               f"--grad_accum={args.gpus // processes}", f"--max_steps={args.steps}", "--lora_r=16", "--lora_alpha=32",
               "--lora_target_modules=attention", "--lora_experts", "--gradient_checkpointing", f"--dtype={args.dtype}",
               f"--device={args.device}", "--lr=1e-4", "--save_interval=0", "--noself_check", *launch]
    os.makedirs(out, exist_ok=True)
    with open(out + ".log", "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"proxy_run: {processes} process(es) failed (exit {done.returncode}); see {out}.log")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def planned(config: str, args, gpus: int) -> int:
    """py/plan.py's bytes per GPU for the layout (the same flags as the run)."""
    command = [sys.executable, os.path.join(ROOT, "py", "plan.py"), f"--model_config={config}", f"--gpus={gpus}",
               f"--expert_parallel={gpus}", f"--seq_len={args.tokens}", "--micro_batch_size=1", "--finetune=lora",
               "--lora_r=16", "--lora_target_modules=attention", "--lora_experts", "--gradient_checkpointing",
               f"--dtype={args.dtype}"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"proxy_run: the planner failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["total_bytes"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(bench_model.PROXIES), default="glm5")
    parser.add_argument("--gpus", type=int, default=2, help="processes of the expert-parallel run")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens a micro-batch (per process)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--override", default="{}", help="JSON: changes to the proxy's config (a small CPU dry run)")
    parser.add_argument("--out", default="build/multi_gpu_check")
    args = parser.parse_args()
    folder = os.path.abspath(os.path.join(args.out, f"proxy_{args.model}"))
    os.makedirs(folder, exist_ok=True)
    config, data = write_inputs(folder, args.model, args.gpus * (args.steps + 1), args.tokens, json.loads(args.override))
    runs = {n: train(os.path.join(folder, f"{n}_process"), config, data, args, n) for n in (1, args.gpus)}
    rate = {n: statistics.median(r["tokens_per_s"] for r in rows[2:] or rows) for n, rows in runs.items()}
    peak = {n: max(r["peak_mem_mib"] for r in rows) * 2**20 for n, rows in runs.items()}
    plan = {n: planned(config, args, n) for n in runs}
    loss_gap = max(abs(a["loss"] - b["loss"]) for a, b in zip(runs[1], runs[args.gpus]))
    result = {"model": args.model, "gpus": args.gpus, "tokens_per_gpu": args.tokens, "device": args.device,
              "tokens_per_s": rate, "speedup": rate[args.gpus] / rate[1], "max_loss_difference": loss_gap,
              "losses": {n: [r["loss"] for r in rows] for n, rows in runs.items()},
              "peak_bytes": peak, "planned_bytes": plan, "peak_over_plan": {n: peak[n] / plan[n] for n in runs}}
    print(f"| {args.model} | 1 {args.device}: {rate[1]:,.0f} tokens/s, peak {peak[1] / 2**30:.2f} GiB (plan "
          f"{plan[1] / 2**30:.2f}) | {args.gpus}, expert parallel {args.gpus}: {rate[args.gpus]:,.0f} tokens/s, "
          f"peak {peak[args.gpus] / 2**30:.2f} GiB a device (plan {plan[args.gpus] / 2**30:.2f}) | "
          f"{result['speedup']:.2f}x | losses at most {loss_gap:.2e} apart |")
    with open(os.path.join(folder, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
