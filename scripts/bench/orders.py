"""Does a trained hotel policy read the wished feature, or book by position? Its held-out success when each test
request's listing comes in K orders, beside the untrained model's and scripted policies' under the same orders.

A policy blind to the rooms' features books by position; over K orders of one listing it books a fitting room about
as often as that position holds one, where a policy that reads books it every time. The run's own evaluation cannot
tell them apart on env=hotel's 12 default test requests: "the second of two rooms, else the first" books 11 of 12
right there (docs/results.md, 2026-12-08). Here each test request is played greedily (as the run's evaluation
plays it: the runtime's decode loop, up to env.max_turns turns of env.turn_max_new_tokens) with its listing in the
order the call gets (order 0, as the run's evaluation saw it) and in K-1 more (the env's episode seeds 1..K-1,
env.shuffle_per_episode). The conversation is rendered by the chat template each turn, as env=hotel_seed's
score_episode does.

    .venv/bin/python scripts/bench/orders.py outputs/bench_multiturn/*/seed-steps-seed27 --orders 4
"""

import argparse
import statistics
import time
from pathlib import Path

import harness
import torch
from multiturn import best_position_per_length

from grpo_pipeline.envs.hotel import HotelEnv, listed_ids, right_search
from grpo_pipeline.models import load_model, load_tokenizer
from grpo_pipeline.recipe import _split
from grpo_pipeline.rollout.turns import SharedPrefix, generate
from grpo_pipeline.tools.rescore import run_config

GREEDY = {"do_sample": False}


def play(model, tokenizer, env: HotelEnv, test: list[dict], orders: int) -> list[list[dict]]:
    """Greedy episodes: per test row, one per order (seed None: the call's order; 1..orders-1: reshuffled)."""
    seeds = [None, *range(1, orders)]
    episodes = [(row, seed, list(row["prompt"])) for row in test for seed in seeds]
    live = list(range(len(episodes)))
    eos = [tokenizer.eos_token_id]
    for _turn in range(env.max_turns):
        if not live:
            break
        texts = [tokenizer.apply_chat_template(episodes[i][2], tokenize=False, add_generation_prompt=True)
                 for i in live]
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        out = []
        for start in range(0, len(ids), 16):
            chunk = ids[start:start + 16]
            with torch.no_grad():
                out += generate(model, chunk, env.turn_max_new_tokens, GREEDY, eos, tokenizer.pad_token_id,
                                SharedPrefix.build(model, chunk), with_logprobs=False)[0]
        still = []
        for i, new in zip(live, out, strict=True):
            row, seed, messages = episodes[i]
            messages.append({"role": "assistant", "content": tokenizer.decode(new, skip_special_tokens=True)})
            reply = env.reply(messages, row["request"], seed)
            if reply is not None:
                messages.append(reply)
                still.append(i)
        live = still
    return [[row, seed, messages[len(row["prompt"]):]] for row, seed, messages in episodes]


def scripted(env: HotelEnv, test: list[dict], orders: int) -> dict[str, float]:
    """Success under the same orders of: the right search then the first listed room; then, for each listing length,
    the one position that books the most of these listings right (fitted on them: the most a policy blind to the
    features scores here); then the first room meeting every wish (the oracle)."""
    cases = []
    for row in test:
        for seed in [None, *range(1, orders)]:
            search = [{"role": "assistant", "content": right_search(row["request"])}]
            listed = [env.rooms[i] for i in listed_ids(env.reply(search, row["request"], seed)["content"])]
            cases.append((row["request"], listed))
    best = best_position_per_length(env, cases)
    return {"first listed": statistics.fmean(env.fits(listed[0], r) for r, listed in cases),
            "best position per length": statistics.fmean(env.fits(listed[best[len(listed)]], r) for r, listed in cases),
            "oracle": statistics.fmean(any(env.fits(x, r) for x in listed) for r, listed in cases)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--orders", type=int, default=4, help="orders per test request (the first: the call's own)")
    parser.add_argument("--base", action="store_true", help="also the untrained model")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    harness.threads(args.threads)
    from peft import PeftModel

    cfg = run_config(args.run_dirs[0], [])
    kwargs = {k: v for k, v in cfg.env.items() if k != "_target_"} | {"shuffle_results": True,
                                                                      "shuffle_per_episode": True}
    env = HotelEnv(**kwargs)
    test = list(_split(cfg, env, env.build_dataset(None)).test)  # the runs' own test requests
    tokenizer = load_tokenizer(cfg.model)
    harness.machine(f"{len(test)} test requests x {args.orders} listing orders, greedy")
    table = harness.Table("policy                                   ", "success, call's order", "success, all orders",
                          "mean reward, all orders", "requests right in every order", "s")
    models = [("untrained", None)] if args.base else []
    models += [(f"{d.parent.name}/{d.name}", d) for d in args.run_dirs]
    for name, run_dir in models:
        started = time.monotonic()
        model = load_model(cfg.model, tokenizer)
        if run_dir is not None:
            model = PeftModel.from_pretrained(model, str(run_dir / "model")).merge_and_unload()
        episodes = play(model.eval(), tokenizer, env, test, args.orders)
        scores = [env.score_episode(None, None, m, row["request"]) for row, _, m in episodes]
        own = [s for (_, seed, _), s in zip(episodes, scores, strict=True) if seed is None]
        per_request = [scores[i:i + args.orders] for i in range(0, len(scores), args.orders)]
        table.row(name, f"{statistics.fmean(s == 1.0 for s in own):.2f}",
                  f"{statistics.fmean(s == 1.0 for s in scores):.2f}", f"{statistics.fmean(scores):.3f}",
                  f"{sum(all(s == 1.0 for s in r) for r in per_request)}/{len(per_request)}",
                  f"{time.monotonic() - started:.0f}")
    for name, success in scripted(env, test, args.orders).items():
        print(f"scripted, {name}: success over all orders {success:.2f}")


if __name__ == "__main__":
    main()
