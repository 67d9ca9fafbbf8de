"""Does the embedded default learn, on every seed? Runs the default config (SmolLM2-135M, arithmetic, LoRA)
once per seed and prints, per seed and as mean / std / min: held-out test mean reward and success rate
before -> after (the weights in model/: the best validation step's if it clearly beat the last, else the
last; `model` is that step), the best and last validation scores, the share of flat groups, and wall time
split into training, validation and test evaluation.

    .venv/bin/python scripts/bench_learning.py                      # seeds 0-4, the default config
    .venv/bin/python scripts/bench_learning.py --seeds 5 6 -- training.learning_rate=5e-4

Goal (issue 12): gain >= +0.25 on every seed, mean >= +0.35, <= 12 min of training + eval per seed on 2
cores. Results also go to outputs/bench_learning/<stamp>/results.json as each seed finishes.
"""

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from grpo_pipeline.config import CONFIG_DIR
from grpo_pipeline.config.schema import register_configs
from grpo_pipeline.recipe import train
from grpo_pipeline.tracking.mlflow_run import default_tracking_uri, metric_history


def run_seed(seed: int, overrides: list[str], out: Path) -> dict:
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"seed={seed}", f"output_dir={out / f'seed{seed}'}",
                                          "tracking.experiment_name=bench_learning", *overrides])
    started = time.monotonic()
    r = train(cfg, launch_dir=os.getcwd(), overrides=[f"seed={seed}", *overrides])
    wall = time.monotonic() - started
    flat = _metric(r.mlflow_run_id, "frac_reward_zero_std")
    return {
        "seed": seed, "before": r.eval_before["mean_reward"], "after": r.eval_after["mean_reward"],
        "gain": r.eval_after["mean_reward"] - r.eval_before["mean_reward"], "gain_se": r.eval_after.get("gain_se"),
        "test_prompts": r.eval_after["num_prompts"],
        "success_before": r.eval_before["success_rate"], "success_after": r.eval_after["success_rate"],
        "best_step": r.best_step, "best_val": r.best_val, "last_val": r.last_val, "steps": r.steps,
        "model_step": r.model_step,
        "flat_groups": statistics.fmean(flat) if flat else None,
        "train_s": r.train_seconds - r.eval_seconds, "val_s": r.eval_seconds,
        "other_s": wall - r.train_seconds, "wall_s": wall,  # other: test evaluations, loading, saving
        "validation": r.validation, "rewards": r.rewards, "flat_curve": flat,
    }


def _metric(run_id: str, key: str) -> list[float]:
    return metric_history(default_tracking_uri(os.getcwd()), run_id, key)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the machine has 2 cores)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides applied to every seed")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    register_configs()
    out = Path("outputs/bench_learning") / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in args.seeds:
        rows.append(run_seed(seed, args.overrides, out))
        (out / "results.json").write_text(json.dumps({"overrides": args.overrides, "rows": rows}, indent=1))
        print_table(rows, args.overrides)


def print_table(rows: list[dict], overrides: list[str]) -> None:
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{torch.get_num_threads()} torch threads; overrides: {overrides}")
    print(f"{'seed':>4} | {'test mean reward':>17} | {'gain (+- SE)':>14} | {'success':>11} | best step (val) | "
          f"last val | model | flat | train s | val s | other s | total s")
    for r in rows:
        print(f"{r['seed']:>4} | {r['before']:>7.3f} -> {r['after']:<6.3f} | {r['gain']:+.3f} +- {r['gain_se'] or 0:.3f} | "
              f"{r['success_before']:.2f} -> {r['success_after']:.2f} | {r['best_step']!s:>4} ({r['best_val'] or 0:.3f})"
              f"    | {r['last_val'] or 0:.3f}    | {r.get('model_step')!s:>5} | {r['flat_groups'] or 0:.2f} | "
              f"{r['train_s']:>7.0f} | "
              f"{r['val_s']:>5.0f} | {r['other_s']:>7.0f} | {r['wall_s']:>7.0f}")
    gains = [r["gain"] for r in rows]
    std = statistics.stdev(gains) if len(gains) > 1 else 0.0
    print(f"{rows[0]['test_prompts']} test prompts; gain over {len(gains)} seeds: mean {statistics.fmean(gains):+.3f}, "
          f"std {std:.3f}, min {min(gains):+.3f} "
          f"(goal: mean >= +0.35, every seed >= +0.25); success after: mean "
          f"{statistics.fmean(r['success_after'] for r in rows):.2f}")


if __name__ == "__main__":
    main()
