"""What the decode loop's KV-cache handling saves on multi-turn rollouts: one rollout of env=hotel (8 episodes, up to
3 assistant turns of 64 tokens, the env's replies in between; SmolLM2-135M + the default LoRA), from the float32
copy and from the bfloat16 one, three ways:

  before      every turn prefilled again from the shared prefix; the KV cache grown by torch.cat (HF's DynamicLayer)
  grow        the cache written into spare room (sampler.GrowingLayer), every turn still prefilled
  grow+keep   and each episode's cache kept between turns (turn k+1 feeds only its new tokens): the runtime today

All modes start from the same torch seed, so in float32 they sample the same tokens (the script prints how many
episodes came out identical to "before") and do the same work; they alternate, and each figure is the median of
--repeats after a warm-up. Run it alone on the machine: two jobs on 2 cores slow each other several-fold.

    .venv/bin/python scripts/bench_turn_cache.py
    .venv/bin/python scripts/bench_turn_cache.py --dtypes float32 --repeats 5
"""

import argparse
import os
import platform
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from peft import LoraConfig, get_peft_model

    from grpo_pipeline.api import compose_config
    from grpo_pipeline.envs.runner import EpisodeRunner
    from grpo_pipeline.models import load_model, lora_target_modules, model_type
    from grpo_pipeline.recipe import load_env_and_dataset, sampling
    from grpo_pipeline.rollout import decode as sampler
    from grpo_pipeline.rollout.turns import make_rollout

    growing = sampler.growing_cache

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.threads} torch "
          f"threads; env=hotel, {args.episodes} episodes; median of {args.repeats} after a warm-up")
    print(f"{'copy':<9} | {'before':>8} | {'grow':>8} | {'grow+keep':>9} | before / grow+keep | same episodes "
          "| tokens fed in turns 2+ (keep vs before)")
    policy = None
    modes = ("before", "grow", "grow+keep")
    fed: dict[str, list[int]] = {m: [] for m in modes}
    decode = _count_fed(fed)
    for dtype in args.dtypes:
        cfg = compose_config(["env=hotel", f"runtime.generation_dtype={dtype}"])
        env, tokenizer, dataset, tools = load_env_and_dataset(cfg, render_tools=False)
        columns = [c for c in dataset.column_names if c != "prompt"]
        runner = EpisodeRunner(env, tokenizer, cfg.runtime, columns, sampling=sampling(cfg.generation),
                               group_size=cfg.generation.num_generations)
        rollout = make_rollout(cfg, env, tokenizer, runner, tools)
        if policy is None:
            targets = lora_target_modules(model_type(cfg.model), cfg.lora.target_modules)
            policy = get_peft_model(load_model(cfg.model, tokenizer), LoraConfig(
                r=cfg.lora.r, lora_alpha=cfg.lora.alpha, target_modules=targets, lora_dropout=cfg.lora.dropout,
                task_type="CAUSAL_LM"))
        runner.bind(policy)
        prompts = [dataset[i // 4]["prompt"] for i in range(args.episodes)]
        rows = [{c: dataset[i // 4][c] for c in columns} for i in range(args.episodes)]
        sample = sampling(cfg.generation)

        def timed(mode: str, rollout=rollout, prompts=prompts, rows=rows, sample=sample):
            rollout.reuse_cache = mode == "grow+keep"
            sampler.growing_cache = growing if mode != "before" else (lambda cache: cache)
            decode.mode = mode
            fed[mode].clear()
            torch.manual_seed(0)
            started = time.perf_counter()
            trajs = rollout.run(policy, prompts, rows, sample)  # noqa: B023 (policy: the same model throughout)
            return time.perf_counter() - started, [t.completion_ids for t in trajs]

        for mode in modes:  # warm-up
            timed(mode)
        times: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.repeats):
            episodes = {}
            for mode in modes:
                seconds, episodes[mode] = timed(mode)
                times[mode].append(seconds)
            same = sum(x == y for x, y in zip(episodes["before"], episodes["grow+keep"], strict=True))
        t = {m: statistics.median(v) for m, v in times.items()}
        print(f"{dtype:<9} | {t['before']:>7.2f}s | {t['grow']:>7.2f}s | {t['grow+keep']:>8.2f}s | "
              f"{t['before'] / t['grow+keep']:>17.2f}x | {same:>4} of {args.episodes}    | "
              f"{sum(fed['grow+keep'][1:])} vs {sum(fed['before'][1:])}")
    sampler.growing_cache = growing


def _count_fed(fed: dict[str, list[int]]):
    """Wrap the rollout's decode to record how many columns each turn feeds (rows x new columns)."""
    from grpo_pipeline.rollout import turns as rollout_module

    original = rollout_module.decode

    def decode(model, ids, mask, max_new_tokens, sampling, eos_ids, cache=None, prefix_length=0, **kw):
        fed[decode.mode].append(ids.size(0) * (ids.size(1) - prefix_length))
        return original(model, ids, mask, max_new_tokens, sampling, eos_ids, cache, prefix_length, **kw)

    decode.mode = "grow+keep"
    rollout_module.decode = decode
    return decode


if __name__ == "__main__":
    main()
