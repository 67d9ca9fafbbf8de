"""Do vLLM and the runtime's HF loop sample episodes of the same lengths? `bench_rollouts.py` counted ~15% fewer
tokens per hotel rollout through vLLM (887 vs 1000-1057), over 3-4 rollouts of the same 2 prompts x 4 episodes.
This probe samples many more episodes, over distinct prompts, both ways from the same policy (SmolLM2 + a fresh
LoRA adapter), and prints per-turn lengths, turns and how episodes ended; then turn 1 alone, 64 completions of the
same 8 contexts each way. Same sampling (temperature 1, no top-k/top-p), same eos ids.

    make install-vllm && .venv-vllm/bin/python scripts/probe_vllm_lengths.py --rollouts 4
"""

import argparse
import json
import os
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rollouts", type=int, default=4, help="rollouts of 8 episodes (8 distinct prompts) per side")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from peft import LoraConfig, get_peft_model

    from grpo_pipeline.api import compose_config
    from grpo_pipeline.envs.runner import EpisodeRunner
    from grpo_pipeline.models import load_model, lora_target_modules, model_type
    from grpo_pipeline.recipe import load_env_and_dataset, sampling
    from grpo_pipeline.rollout.turns import generate, make_rollout

    sides = {}
    for side, overrides in (("HF", ["vllm=off"]), ("vLLM", ["vllm=colocate", "vllm.weight_sync=weights"])):
        cfg = compose_config(["env=hotel", *overrides])
        env, tokenizer, dataset, tools = load_env_and_dataset(cfg, render_tools=False)
        columns = [c for c in dataset.column_names if c != "prompt"]
        runner = EpisodeRunner(env, tokenizer, cfg.runtime, columns, sampling=sampling(cfg.generation),
                               group_size=cfg.generation.num_generations)
        sides[side] = make_rollout(cfg, env, tokenizer, runner, tools)
    targets = lora_target_modules(model_type(cfg.model), cfg.lora.target_modules)
    policy = get_peft_model(load_model(cfg.model, tokenizer), LoraConfig(
        r=cfg.lora.r, lora_alpha=cfg.lora.alpha, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM"))
    for rollout in sides.values():
        rollout.runner.bind(policy)
    sample = sampling(cfg.generation)
    limit = sides["HF"].turn_tokens

    for side, rollout in sides.items():
        turns, lengths, ends, started = [], {}, [], time.perf_counter()
        for k in range(args.rollouts):
            rows_at = range(8 * k, 8 * k + 8)
            torch.manual_seed(k)
            trajs = rollout.run(policy, [dataset[i]["prompt"] for i in rows_at],
                                [{c: dataset[i][c] for c in columns} for i in rows_at], sample)
            for t in trajs:
                for turn, n in enumerate(_assistant_runs(t.env_mask)):
                    lengths.setdefault(turn + 1, []).append(n)
                turns.append(t.turns)
                ends.append("cut" if t.cut else "failed" if t.failure else "env done" if t.done else "max turns")
        print(side, json.dumps({
            "episodes": len(turns), "tokens per episode": round(sum(map(sum, lengths.values())) / len(turns), 1),
            "turns per episode": round(statistics.fmean(turns), 2),
            "mean tokens per turn": {k: round(statistics.fmean(v), 1) for k, v in lengths.items()},
            f"turn 1 at the {limit}-token limit": round(sum(n >= limit for n in lengths[1]) / len(lengths[1]), 2),
            "ended": {e: ends.count(e) for e in sorted(set(ends))},
            "seconds": round(time.perf_counter() - started, 1)}), flush=True)

    contexts = [sides["HF"]._start(dataset[i]["prompt"], {}).prompt_ids for i in range(8)] * 8
    hf = sides["HF"]
    for side, rollout in sides.items():
        torch.manual_seed(123)
        if side == "HF":
            ids, _ = generate(hf.sampler.of(policy), contexts, limit, sample, hf.eos_ids, hf.pad_id, with_logprobs=False)
        else:
            rollout.vllm.sync(policy)
            ids, _ = rollout.vllm.generate(contexts, limit, sample, hf.eos_ids, with_logprobs=False)
        n = [len(x) for x in ids]
        print(f"{side} turn 1, {len(ids)} completions of 8 contexts: mean {statistics.fmean(n):.1f} tokens, "
              f"{sum(x >= limit for x in n)} at the limit, {sum(bool(x) and x[-1] in hf.eos_ids for x in ids)} ended "
              "by eos", flush=True)
    for rollout in sides.values():
        rollout.close()


def _assistant_runs(env_mask: list[int]) -> list[int]:
    """The lengths of the runs of sampled tokens (assistant turns) in a trajectory's env_mask."""
    runs, n = [], 0
    for m in env_mask:
        if m:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs + [n] if n else runs


if __name__ == "__main__":
    main()
