"""Is the automatic sampling dtype right on this CPU? The default run's training steps with
`runtime.generation_dtype=null` (the automatic choice, config/machine.py) against both forced choices
(`float32`, `bfloat16`), side by side in one run: each round trains every variant for --steps steps, in turn,
starting with another variant each round, after one warm-up training that is not counted; the figure of a
variant is the median step time over its steps after the first (warm-up) of every round.

    .venv/bin/python scripts/bench_dtype.py                    # 3 rounds x 3 variants x 4 steps (~13 min, 2 cores)
    .venv/bin/python scripts/bench_dtype.py --rounds 1 --steps 3

The target (issue 35): automatic <= 1.05x the faster forced choice. Run it alone on the machine: two jobs on
2 cores slow each other several-fold.
"""

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time

import torch

VARIANTS = {"auto": "null", "float32": "float32", "bfloat16": "bfloat16"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides for every variant")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from grpo_pipeline.api import train
    from grpo_pipeline.config.machine import cpu_name, sampling_dtype
    from grpo_pipeline.training import trainer

    seconds: list[float] = []
    original = trainer.PipelineTrainer.training_step

    @functools.wraps(original)
    def timed(self, *a, **k):
        started = time.perf_counter()
        try:
            return original(self, *a, **k)
        finally:
            seconds.append(time.perf_counter() - started)

    trainer.PipelineTrainer.training_step = timed
    choice = sampling_dtype(packed=True)
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores, {args.threads} torch threads")
    print(f"automatic choice: {choice.value} ({choice.why})")
    steps: dict[str, list[float]] = {name: [] for name in VARIANTS}
    def run(value: str, max_steps: int, out: str) -> None:
        train([f"runtime.generation_dtype={value}", f"training.max_steps={max_steps}", "eval.enabled=false",
               "ledger.enabled=false", "tracking.enabled=false", "training.save_model=false", f"output_dir={out}",
               *args.overrides])

    with tempfile.TemporaryDirectory() as tmp:
        run("null", 2, os.path.join(tmp, "warm-up"))  # the process's first training is slower (first loads, kernels)
        names = list(VARIANTS)
        for r in range(args.rounds):
            for name in names[r % 3:] + names[: r % 3]:  # each round starts with another variant
                seconds.clear()
                run(VARIANTS[name], args.steps, os.path.join(tmp, f"{name}-{r}"))
                steps[name] += seconds[1:]  # the first step warms up (oneDNN kernels, the copy's first build)
                print(f"  round {r + 1} {name:<8}: " + " ".join(f"{s:.1f}" for s in seconds) + " s", flush=True)
    med = {name: statistics.median(values) for name, values in steps.items()}
    print(f"\n{'variant':<9} | median step (s) | steps")
    for name in VARIANTS:
        print(f"{name:<9} | {med[name]:>15.2f} | {len(steps[name])}")
    best = min(med["float32"], med["bfloat16"])
    ratio = med["auto"] / best
    print(f"\nautomatic / faster forced choice = {ratio:.3f} (target <= 1.05): {'PASS' if ratio <= 1.05 else 'FAIL'}")
    return 0 if ratio <= 1.05 else 1


if __name__ == "__main__":
    sys.exit(main())
