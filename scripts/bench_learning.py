"""Does the embedded default learn? Runs the default config (SmolLM2-135M, arithmetic, LoRA) for each
seed and prints held-out mean reward / success rate before -> after, steps and wall time.

    .venv/bin/python scripts/bench_learning.py                 # seeds 0 and 1, the default config
    .venv/bin/python scripts/bench_learning.py --seeds 0 -- training.learning_rate=5e-4

Success rate = share of held-out prompts scoring 1.0 (tagged and right). Goal (issue 8): mean reward
gain >= +0.35, averaged over 2 seeds, within 12 minutes of training on 2 cores.
"""

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from grpo_pipeline.config import CONFIG_DIR
from grpo_pipeline.config.schema import register_configs
from grpo_pipeline.recipe import train


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides applied to every seed")
    args = parser.parse_args()
    register_configs()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rows = []
    for seed in args.seeds:
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose("train", overrides=[
                f"seed={seed}", f"output_dir=outputs/bench_learning/{stamp}/seed{seed}",
                "tracking.experiment_name=bench_learning", *args.overrides,
            ])
        started = time.monotonic()
        result = train(cfg, launch_dir=os.getcwd(), overrides=[f"seed={seed}", *args.overrides])
        rows.append((seed, result, time.monotonic() - started))

    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; overrides: {args.overrides}")
    print(f"{'seed':>4} | {'mean reward before -> after':>28} | {'success before -> after':>24} | steps | train+eval s")
    for seed, r, wall in rows:
        b, a = r.eval_before, r.eval_after
        print(f"{seed:>4} | {b['mean_reward']:>12.3f} -> {a['mean_reward']:<12.3f} | "
              f"{b['success_rate']:>9.2f} -> {a['success_rate']:<11.2f} | {r.steps:>5} | {wall:>8.0f}")
    gain = statistics.fmean(r.eval_after["mean_reward"] - r.eval_before["mean_reward"] for _, r, _ in rows)
    print(f"average held-out mean reward gain: {gain:+.3f} (goal >= +0.35)")
    Path(f"outputs/bench_learning/{stamp}").mkdir(parents=True, exist_ok=True)


if __name__ == "__main__":
    main()
