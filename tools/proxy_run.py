"""Issue 20's runs of //py:train on several GPUs (on the CPU with gloo as their dry runs), in one job:

    python3 tools/proxy_run.py --model glm5 --gpus 2 --tokens 4096 --steps 8 --out build/multi_gpu_check
    python3 tools/proxy_run.py --config testdata/released/GLM-5-FP8/config.json --gpus 8 --tokens 4096 --steps 20

--model: a proxy of tools/bench_model.py trained on one device and on N with expert parallelism N,
on the same global batch, side by side: writes the proxy's config.json and random token rows (one
document of --tokens per row), runs py/train.py with LoRA r=16 on attention and experts, C++
checkpointing, bf16: 1 process accumulating N micro-batches, then N processes (--nproc_per_node=N
--expert_parallel=N) one each; reads their metrics.jsonl. Prints, and writes as JSON: tokens/s
of both (the median step after the first two) and their ratio, the largest per-step loss
difference, rank 0's peak memory against py/plan.py's prediction for each layout.

--config instead: that model whole (GLM-5 744B from the released config: all layers, 256
experts) on N processes only, expert parallel N, its random base drawn on the devices (FP8 as the
config's quantization_config says; --model_config, no file), the same LoRA and checkpointing, the
last step profiled on rank 0 (--profile_step). Prints, and writes as JSON: tokens/s per GPU (the
median step after the first two, the profiled one left out), rank 0's peak memory against
py/plan.py's prediction, and the profiled step's time split into compute and communication.
--override changes the config (a small one for the CPU dry run); per-layer lists follow a new
num_hidden_layers (their first entries kept).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import bench_model  # noqa: E402

LORA = ["--lora_r=16", "--lora_alpha=32", "--lora_target_modules=attention", "--lora_experts",
        "--gradient_checkpointing"]


def write_data(folder: str, vocab: int, rows: int, tokens: int) -> str:
    """A JSONL of `rows` random rows of `tokens` ids below `vocab`, in folder."""
    data, gen = os.path.join(folder, "data.jsonl"), random.Random(0)
    with open(data, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"input_ids": [gen.randrange(vocab) for _ in range(tokens)]}) + "\n")
    return data


def write_inputs(folder: str, model: str, rows: int, tokens: int, overrides: dict) -> tuple[str, str]:
    """(the proxy's config.json, a JSONL of `rows` random rows of `tokens` ids) in folder."""
    hf_cfg, _ = bench_model.PROXIES[model](**overrides)
    config = os.path.join(folder, "config.json")
    with open(config, "w") as f:
        json.dump(hf_cfg.to_dict(), f)
    return config, write_data(folder, hf_cfg.vocab_size, rows, tokens)


def write_config(folder: str, source: str, overrides: dict) -> tuple[str, dict]:
    """(config.json in folder, its dict): `source` changed by `overrides`; a per-layer list (as long
    as the source's num_hidden_layers) cut or extended to a new num_hidden_layers."""
    with open(source) as f:
        config = json.load(f)
    layers = overrides.get("num_hidden_layers", config.get("num_hidden_layers"))
    for key, value in config.items():
        if isinstance(value, list) and len(value) == config.get("num_hidden_layers") and key not in overrides:
            config[key] = (value + value[-1:] * layers)[:layers]
    config.update(overrides)
    path = os.path.join(folder, "config.json")
    with open(path, "w") as f:
        json.dump(config, f, indent=1)
    return path, config


def train(out: str, config: str, data: str, args, processes: int, extra: tuple[str, ...] = ()) -> list[dict]:
    """py/train.py's metrics rows for one layout (its log beside them)."""
    launch = [f"--nproc_per_node={processes}", f"--expert_parallel={processes}"] if processes > 1 else []
    command = [sys.executable, os.path.join(ROOT, "py", "train.py"), f"--model_config={config}", f"--data={data}",
               f"--output_dir={out}", "--overwrite_output_dir", f"--seq_len={args.tokens}", "--micro_batch_size=1",
               f"--grad_accum={args.gpus // processes}", f"--max_steps={args.steps}", *LORA, f"--dtype={args.dtype}",
               f"--device={args.device}", "--lr=1e-4", "--save_interval=0", "--noself_check", *launch, *extra]
    os.makedirs(out, exist_ok=True)
    with open(out + ".log", "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    if done.returncode != 0:  # the log in the message (a CI run keeps only what its test printed):
        with open(out + ".log", errors="replace") as log:  # the ranks' errors, then torchrun's summary
            lines = log.readlines()
        errors = [line for line in lines[:-30] if re.search(r"^(\[rank\d+\]: )?(train: |\w*Error\b|terminate )", line)]
        shown = "".join(errors[-20:] + ["...\n"] + lines[-30:] if len(lines) > 30 else lines)
        raise SystemExit(f"proxy_run: {processes} process(es) failed (exit {done.returncode}); {out}.log:\n{shown}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def planned(config: str, args, gpus: int) -> int:
    """py/plan.py's bytes per GPU for the layout (the same flags as the run)."""
    command = [sys.executable, os.path.join(ROOT, "py", "plan.py"), f"--model_config={config}", f"--gpus={gpus}",
               f"--expert_parallel={gpus}", f"--seq_len={args.tokens}", "--micro_batch_size=1", "--finetune=lora",
               *LORA, f"--dtype={args.dtype}"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"proxy_run: the planner failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["total_bytes"]


def median_rate(rows: list[dict]) -> float:
    """tokens/s of the median step after the first two (warm-up), profiled steps left out."""
    steady = [r["tokens_per_s"] for r in rows[2:] if "profile" not in r]
    return statistics.median(steady or [r["tokens_per_s"] for r in rows])


def proxies(args, folder: str) -> dict:
    config, data = write_inputs(folder, args.model, args.gpus * (args.steps + 1), args.tokens,
                                json.loads(args.override))
    runs = {n: train(os.path.join(folder, f"{n}_process"), config, data, args, n) for n in (1, args.gpus)}
    rate = {n: median_rate(rows) for n, rows in runs.items()}
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
    return result


def config_name(path: str) -> str:
    """A config's name: its folder's (testdata/released/GLM-5-FP8/config.json: GLM-5-FP8)."""
    return os.path.basename(os.path.dirname(os.path.abspath(path)))


def whole_model(args, folder: str) -> dict:
    config, hf = write_config(folder, os.path.join(ROOT, args.config), json.loads(args.override))
    data = write_data(folder, hf["vocab_size"], args.gpus * (args.steps + 1), args.tokens)
    rows = train(os.path.join(folder, f"{args.gpus}_process"), config, data, args, args.gpus,
                 ("--nosave_base_model", f"--profile_step={args.steps}"))
    profile = next(r["profile"] for r in rows if "profile" in r)
    rate = median_rate(rows) / args.gpus  # the trainer's tokens/s are the step's, every rank's tokens
    peak, plan = max(r["peak_mem_mib"] for r in rows) * 2**20, planned(config, args, args.gpus)
    result = {"config": args.config, "overrides": json.loads(args.override), "gpus": args.gpus,
              "expert_parallel": args.gpus, "tokens_per_gpu": args.tokens, "device": args.device,
              "steps": len(rows), "tokens_per_s_per_gpu": rate, "losses": [r["loss"] for r in rows],
              "peak_bytes_rank0": peak, "planned_bytes": plan, "peak_over_plan": peak / plan, "profile": profile}
    split = ", ".join(f"{k.removesuffix('_s')} {v:.3f} s" for k, v in profile.items() if k != "step_s")
    print(f"| {config_name(args.config)} ({hf['num_hidden_layers']} layers, "
          f"{hf.get('n_routed_experts') or hf.get('num_experts')} experts) | {args.gpus} x {args.device}, expert "
          f"parallel {args.gpus}, {args.tokens:,} tokens a GPU | {rate:,.0f} tokens/s a GPU | rank 0's peak "
          f"{peak / 2**30:.2f} GiB, plan {plan / 2**30:.2f} ({peak / plan:.2f}x) | profiled step "
          f"{profile['step_s']:.3f} s: {split} | loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f} |")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(bench_model.PROXIES), default="glm5",
                        help="a tools/bench_model.py proxy")
    parser.add_argument("--config", help="a config.json to train whole on --gpus processes from a random base "
                        "(instead of --model), e.g. testdata/released/GLM-5-FP8/config.json")
    parser.add_argument("--gpus", type=int, default=2, help="processes of the expert-parallel run")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens a micro-batch (per process)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--override", default="{}", help="JSON: changes to the config (a small CPU dry run)")
    parser.add_argument("--out", default="build/multi_gpu_check")
    args = parser.parse_args()
    if args.config and args.steps < 4:
        parser.error(f"--steps={args.steps}: --config needs at least 4 (two of warm-up, one profiled, one timed)")
    folder = os.path.abspath(os.path.join(args.out, config_name(args.config) if args.config else f"proxy_{args.model}"))
    os.makedirs(folder, exist_ok=True)
    result = whole_model(args, folder) if args.config else proxies(args, folder)
    with open(os.path.join(folder, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
