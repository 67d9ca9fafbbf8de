"""What continuing each episode's KV cache saves a seed-style env's own generate calls: one training batch of
env=hotel_seed (8 episodes; the env renders its whole conversation and calls model.generate for turns 2..3; SmolLM2
+ the default LoRA), the first replies sampled by the rollout, then the env's calls recorded as in training, two ways:

  prefill   every call feeds its whole context again (the episode caches switched off)
  continue  a call whose context starts with its episode's tokens feeds only what follows them (the runtime today)

Timed: the batch's scoring (the env's calls), median of --repeats after a warm-up, the two ways alternating, each
from the same torch seed (the first replies are the same; the env's calls may sample differently). Also printed:
the tokens the calls fed before sampling, and the env turns recorded and rebased. Run it alone on the machine.

    .venv/bin/python scripts/bench/env_calls.py
    .venv/bin/python scripts/bench/env_calls.py --repeats 5 --episodes 16
"""

import argparse
import functools
import time

import harness
import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--episodes", type=int, default=8)
    args = parser.parse_args()
    harness.threads(args.threads)

    from grpo_pipeline.envs.recorder import CallRecorder
    from grpo_pipeline.recipe import sampling
    from grpo_pipeline.rollout import turns as rollout_module

    harness.machine(f"env=hotel_seed, {args.episodes} episodes; median of {args.repeats} after a warm-up")
    rollout, cfg, tokenizer, dataset, columns = harness.rollout(["env=hotel_seed"])
    policy = harness.lora_policy(cfg, tokenizer)
    runner = rollout.runner
    runner.bind(policy)
    prompts = [dataset[i // 4]["prompt"] for i in range(args.episodes)]
    rows = [{c: dataset[i // 4][c] for c in columns} for i in range(args.episodes)]
    sample = sampling(cfg.generation)
    fed: list[int] = []
    decode = rollout_module.decode

    def counting(model, ids, mask, *a, **kw):  # real tokens fed before sampling (after the cached columns)
        fed.append(int(mask[:, (a[4] if len(a) > 4 else kw.get("prefix_length", 0)):].sum()))
        return decode(model, ids, mask, *a, **kw)

    rollout_module.decode = counting
    batches: list[int] = []  # rows of each batch of env calls the decode loop ran
    fast = runner.fast_generate

    def batched(sequences, *a):
        batches.append(len(sequences))
        return fast(sequences, *a)

    runner.fast_generate = batched
    stats: dict[str, dict] = {}

    def scored(mode: str, _round: int):
        rollout.for_env = mode == "continue"
        torch.manual_seed(0)
        trajs = rollout.run(policy, prompts, rows, sample)
        recorders = [CallRecorder(sample, t.prompt_ids + t.completion_ids, tokenizer) for t in trajs]
        fed.clear()
        batches.clear()
        started = time.perf_counter()
        runner.run_episodes([t.text for t in trajs], rows, recorders=recorders)
        if _round >= 0:  # the scoring alone, not the rollout before it
            seconds[mode].append(time.perf_counter() - started)
        rollout.release_episode_caches()
        stats[mode] = {"fed": sum(fed), "turns": sum(len(r.samples) for r in recorders),
                       "rebased": sum(r.rebased_calls for r in recorders), "batches": list(batches)}

    seconds: dict[str, list[float]] = {"prefill": [], "continue": []}
    harness.alternate({m: functools.partial(scored, m) for m in seconds}, args.repeats)
    t = harness.medians(seconds)
    table = harness.Table("way     ", "scoring (env calls)", "tokens fed before sampling", "env turns recorded",
                          "rebased", "rows of each batch of calls")
    for mode in ("prefill", "continue"):
        s = stats[mode]
        table.row(mode, harness.secs(t[mode]), s["fed"], s["turns"], s["rebased"], " ".join(map(str, s["batches"])))
    print(f"prefill / continue: {harness.ratio(t['prefill'], t['continue'])}")


if __name__ == "__main__":
    main()
