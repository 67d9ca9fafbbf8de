"""Is the automatic sampling dtype right on this CPU? The default run's training steps with
`runtime.generation_dtype=null` (the automatic choice, config/machine.py) against both forced choices
(`float32`, `bfloat16`), side by side in one run: each round trains every variant for --steps steps, in turn,
starting with another variant each round, after one warm-up training that is not counted; the figure of a
variant is the median step time over its steps after the first (warm-up) of every round.

    .venv/bin/python scripts/bench/dtype.py                    # 3 rounds x 3 variants x 4 steps (~13 min, 2 cores)
    .venv/bin/python scripts/bench/dtype.py --rounds 1 --steps 3

The target (issue 35): automatic <= 1.05x the faster forced choice. Run it alone on the machine: two jobs on
2 cores slow each other several-fold.
"""

import argparse
import os
import sys
import tempfile

import harness

VARIANTS = {"auto": "null", "float32": "float32", "bfloat16": "bfloat16"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides for every variant")
    args = parser.parse_args()
    harness.threads(args.threads)

    from grpo_pipeline.api import train
    from grpo_pipeline.config.machine import sampling_dtype
    from grpo_pipeline.training import trainer

    seconds: list[float] = []
    harness.record(trainer.PipelineTrainer, "training_step", seconds)
    choice = sampling_dtype(packed=True)
    harness.machine()
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
    med = harness.medians(steps)
    best = min(med["float32"], med["bfloat16"])
    table = harness.Table("variant  ", "median step", "steps", "/ faster forced")
    for name in VARIANTS:
        table.row(name, harness.secs(med[name]), len(steps[name]), harness.ratio(med[name], best))
    ratio = med["auto"] / best
    print(f"\nautomatic / faster forced choice = {ratio:.3f} (target <= 1.05): {'PASS' if ratio <= 1.05 else 'FAIL'}")
    return 0 if ratio <= 1.05 else 1


if __name__ == "__main__":
    sys.exit(main())
