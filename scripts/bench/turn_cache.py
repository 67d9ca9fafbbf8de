"""What the decode loop's KV-cache handling saves on multi-turn rollouts: one rollout of env=hotel (8 episodes, up to
3 assistant turns of 64 tokens, the env's replies in between; SmolLM2-135M + the default LoRA), from the float32
copy and from the bfloat16 one, three ways:

  before      every turn prefilled again from the shared prefix; the KV cache grown by torch.cat (HF's DynamicLayer)
  grow        the cache written into spare room (sampler.GrowingLayer), every turn still prefilled
  grow+keep   and each episode's cache kept between turns (turn k+1 feeds only its new tokens): the runtime today

All modes start from the same torch seed, so in float32 they sample the same tokens (the script prints how many
episodes came out identical to "before") and do the same work; they alternate, and each figure is the median of
--repeats after a warm-up. Run it alone on the machine: two jobs on 2 cores slow each other several-fold.

    .venv/bin/python scripts/bench/turn_cache.py
    .venv/bin/python scripts/bench/turn_cache.py --dtypes float32 --repeats 5
"""

import argparse
import functools

import harness
import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    harness.threads(args.threads)

    from grpo_pipeline.recipe import sampling
    from grpo_pipeline.rollout import decode as sampler

    growing = sampler.growing_cache

    harness.machine(f"env=hotel, {args.episodes} episodes; median of {args.repeats} after a warm-up")
    table = harness.Table("copy     ", "before", "grow", "grow+keep", "before / grow+keep", "same episodes",
                          "tokens fed in turns 2+ (keep vs before)")
    policy = None
    modes = ("before", "grow", "grow+keep")
    fed: dict[str, list[int]] = {m: [] for m in modes}
    decode = _count_fed(fed)
    for dtype in args.dtypes:
        rollout, cfg, tokenizer, dataset, columns = harness.rollout(["env=hotel", f"runtime.generation_dtype={dtype}"])
        if policy is None:
            policy = harness.lora_policy(cfg, tokenizer)
        rollout.runner.bind(policy)
        prompts = [dataset[i // 4]["prompt"] for i in range(args.episodes)]
        rows = [{c: dataset[i // 4][c] for c in columns} for i in range(args.episodes)]
        sample = sampling(cfg.generation)

        episodes: dict[str, list] = {}  # each mode's episodes of its last rollout

        def timed(mode: str, _round: int, rollout=rollout, prompts=prompts, rows=rows, sample=sample,
                  episodes=episodes):
            rollout.reuse_cache = mode == "grow+keep"
            sampler.growing_cache = growing if mode != "before" else (lambda cache: cache)
            decode.mode = mode
            fed[mode].clear()
            torch.manual_seed(0)
            trajs = rollout.run(policy, prompts, rows, sample)  # noqa: B023 (policy: the same model throughout)
            episodes[mode] = [t.completion_ids for t in trajs]

        t = harness.medians(harness.alternate({m: functools.partial(timed, m) for m in modes}, args.repeats))
        same = sum(x == y for x, y in zip(episodes["before"], episodes["grow+keep"], strict=True))
        table.row(dtype, harness.secs(t["before"]), harness.secs(t["grow"]), harness.secs(t["grow+keep"]),
                  harness.ratio(t["before"], t["grow+keep"]), f"{same} of {args.episodes}",
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
