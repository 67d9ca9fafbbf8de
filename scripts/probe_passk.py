"""What the model can sample on the held-out test set: pass@k (the share of test prompts with at least one full
score among k completions) for k = 1..--samples, at the run's temperature, for the model before training or for a
trained adapter. GRPO mostly sharpens what the model already samples, so this bounds what a run can reach (docs/envs.md,
the env doctor). The test prompts are the run's own (eval.split_seed); completions are sampled from a bf16 copy
(`--dtype float32` on a CPU without native bf16, where bf16 is the slower of the two).

    .venv/bin/python scripts/probe_passk.py                                       # the base model, env=arithmetic
    .venv/bin/python scripts/probe_passk.py --adapter outputs/bench_learning/<stamp>/seed42/model
    .venv/bin/python scripts/probe_passk.py --samples 16 -- env.max_value=49     # Hydra overrides after --
"""

import argparse
import statistics
import time
import warnings

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--adapter", help="a trained LoRA adapter folder (a run's model/); default: the base model")
    parser.add_argument("--samples", type=int, default=32, help="completions per test prompt")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="the sampling copy's dtype (float32 on a CPU without native bf16)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    warnings.filterwarnings("ignore")

    from grpo_pipeline.api import compose_config
    from grpo_pipeline.envs.runner import EpisodeRunner
    from grpo_pipeline.evaluation.heldout import generate, split_heldout
    from grpo_pipeline.models import load_model
    from grpo_pipeline.recipe import load_env_and_dataset, sampling
    from grpo_pipeline.tools.doctor import PASS_KS, pass_at_k

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
    k = args.samples
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


if __name__ == "__main__":
    main()
