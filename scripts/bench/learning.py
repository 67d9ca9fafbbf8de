"""Does the embedded default learn, on every seed? Runs the default config (SmolLM2-135M, arithmetic, LoRA)
once per seed and prints, per seed and as mean / std / min: held-out test mean reward and success rate
before -> after (the weights in model/: the best validation step's if it clearly beat the last, else the
last; `model` is that step), the best and last validation scores, the share of flat groups, and wall time
split into training, validation and test evaluation.

    .venv/bin/python scripts/bench/learning.py                      # seeds 0-4, the default config
    .venv/bin/python scripts/bench/learning.py --seeds 5 6 -- training.learning_rate=5e-4
    .venv/bin/python scripts/bench/learning.py --documents --seeds 100 101 102   # the documents' recipe vs ours

With --documents each seed runs twice, one after the other: this project's default, then the recipe of the
documents our users come from as `translate -- --trainer grpo --peft` gives it (loss grpo, lr 1e-5, 128 new
tokens, top_k 50, kl 0.1, batch 4, no dynamic sampling, one epoch), stopped by `training.max_minutes` after as
much training time as the default took on that seed: the two recipes at equal wall-clock, on the same test sums.
Its validation runs every 20 steps (the default's every 5): the documents' step trains 4 completions, the default's
16, so both validate as often per completion trained, and the same rule picks model/.

Goal (issue 12): gain >= +0.25 on every seed, mean >= +0.35, <= 12 min of training + eval per seed on 2
cores. Results also go to outputs/bench_learning/<stamp>/results.json as each seed finishes.

With --passk K it trains nothing and asks what training can reach: pass@k (the share of held-out test prompts
with at least one full score among k completions) for k = 1..K, at the run's temperature, for the model before
training or a trained adapter (--adapter). GRPO mostly sharpens what the model already samples, so this bounds
what a run can reach (docs/envs.md, the env doctor). The test prompts are the run's own (eval.split_seed);
completions are sampled from a bf16 copy (`--dtype float32` on a CPU without native bf16, where bf16 is slower).

    .venv/bin/python scripts/bench/learning.py --passk 32                 # the base model, env=arithmetic
    .venv/bin/python scripts/bench/learning.py --passk 32 --adapter outputs/bench_learning/<stamp>/seed42/model
    .venv/bin/python scripts/bench/learning.py --passk 16 -- env.max_value=49
"""

import argparse
import json
import os
import statistics
import time
import warnings
from pathlib import Path

import harness
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
    parser.add_argument("--passk", type=int, metavar="K", help="no training: pass@1..K of the test set (K samples each)")
    parser.add_argument("--adapter", help="--passk: a trained LoRA adapter folder (a run's model/); default: the base")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="--passk: the sampling copy's dtype (float32 on a CPU without native bf16)")
    parser.add_argument("--batch", type=int, default=64, help="--passk: completions generated at once")
    parser.add_argument("--documents", action="store_true",
                        help="per seed: the default, then the documents' recipe (translate's) at equal training time")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides applied to every seed")
    args = parser.parse_args()
    harness.threads(args.threads)
    if args.passk:
        return pass_at_ks(args)
    register_configs()
    out = Path("outputs/bench_learning") / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    if args.documents:
        return against_documents(args, out)
    rows = []
    for seed in args.seeds:
        rows.append(run_seed(seed, args.overrides, out))
        (out / "results.json").write_text(json.dumps({"overrides": args.overrides, "rows": rows}, indent=1))
        print_table(rows, args.overrides)


def against_documents(args, out: Path) -> None:
    """Per seed: the default, then the documents' recipe with the default's training minutes (equal wall-clock)."""
    from grpo_pipeline.tools.translate import translate

    # validation as often per completion trained: the documents' step is batch 4, the default's 16 (every 5 steps)
    documents = [*translate(["--trainer", "grpo", "--peft"]), "eval.every_steps=20"]
    rows: dict[str, list[dict]] = {"default": [], "documents": []}
    for seed in args.seeds:
        ours = run_seed(seed, args.overrides, out / "default")
        minutes = (ours["train_s"] + ours["val_s"]) / 60  # the training loop, its validations included
        theirs = run_seed(seed, [*documents, f"training.max_minutes={minutes:.3f}", *args.overrides],
                          out / "documents")
        rows["default"].append(ours)
        rows["documents"].append(theirs)
        (out / "results.json").write_text(json.dumps({"documents": documents, "rows": rows}, indent=1))
        for name, recipe in rows.items():
            print(f"\n{name}: {documents if name == 'documents' else 'the default config'}")
            print_table(recipe, args.overrides)
        diffs = [a["gain"] - b["gain"] for a, b in zip(rows["default"], rows["documents"], strict=True)]
        print(f"\ndefault gain - documents' gain per seed: {', '.join(f'{d:+.3f}' for d in diffs)}; mean "
              f"{statistics.fmean(diffs):+.3f}; steps per seed: default "
              f"{[r['steps'] for r in rows['default']]}, documents {[r['steps'] for r in rows['documents']]}")


def pass_at_ks(args) -> None:
    from grpo_pipeline.api import compose_config
    from grpo_pipeline.envs.runner import EpisodeRunner
    from grpo_pipeline.evaluation.heldout import generate, split_heldout
    from grpo_pipeline.models import load_model
    from grpo_pipeline.recipe import load_env_and_dataset, sampling
    from grpo_pipeline.tools.doctor import PASS_KS, pass_at_k

    torch.manual_seed(0)
    warnings.filterwarnings("ignore")
    harness.machine(f"pass@k, {args.adapter or 'base model'}, overrides: {args.overrides}")
    cfg = compose_config(args.overrides)
    env, tokenizer, dataset, _ = load_env_and_dataset(cfg)
    test = split_heldout(dataset, cfg.eval, type(env).__qualname__).test
    model = load_model(cfg.model, tokenizer).eval()
    if args.adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, args.adapter).merge_and_unload()
    model = model.to(getattr(torch, args.dtype))
    gen = cfg.generation
    sample = sampling(gen)
    extra = [c for c in dataset.column_names if c != "prompt"]
    runner = EpisodeRunner(env, tokenizer, cfg.runtime, extra, sampling=sample)
    runner.bind(model)
    k = args.passk
    prompts = [p for p in test["prompt"] for _ in range(k)]
    rows = [{c: test[i][c] for c in extra} for i in range(len(test)) for _ in range(k)]
    started = time.monotonic()
    completions = generate(model, tokenizer, prompts, gen.max_new_tokens, args.batch, sample)
    scores, _ = runner.score(completions, rows)
    groups = [scores[i : i + k] for i in range(0, len(scores), k)]
    print(f"{len(groups)} test prompts x {k} samples ({args.adapter or 'base model'}), temperature {gen.temperature}, "
          f"{time.monotonic() - started:.0f} s")
    print(", ".join(f"pass@{n} {statistics.fmean(pass_at_k(g, n) for g in groups):.3f}"
                    for n in PASS_KS if n <= k))
    print("full scores per prompt:", sorted(sum(s >= 1.0 for s in g) for g in groups))


def print_table(rows: list[dict], overrides: list[str]) -> None:
    print()
    harness.machine(f"overrides: {overrides}")
    table = harness.Table("seed", "test mean reward", "gain (+- SE)", "success", "best step (val)", "last val",
                          "model", "flat", "train s", "val s", "other s", "total s")
    for r in rows:
        table.row(r["seed"], f"{r['before']:.3f} -> {r['after']:.3f}", f"{r['gain']:+.3f} +- {r['gain_se'] or 0:.3f}",
                  f"{r['success_before']:.2f} -> {r['success_after']:.2f}",
                  f"{r['best_step']} ({r['best_val'] or 0:.3f})", f"{r['last_val'] or 0:.3f}", r.get("model_step"),
                  f"{r['flat_groups'] or 0:.2f}", f"{r['train_s']:.0f}", f"{r['val_s']:.0f}", f"{r['other_s']:.0f}",
                  f"{r['wall_s']:.0f}")
    gains = [r["gain"] for r in rows]
    std = statistics.stdev(gains) if len(gains) > 1 else 0.0
    print(f"{rows[0]['test_prompts']} test prompts; gain over {len(gains)} seeds: mean {statistics.fmean(gains):+.3f}, "
          f"std {std:.3f}, min {min(gains):+.3f} "
          f"(goal: mean >= +0.35, every seed >= +0.25); success after: mean "
          f"{statistics.fmean(r['success_after'] for r in rows):.2f}")


if __name__ == "__main__":
    main()
