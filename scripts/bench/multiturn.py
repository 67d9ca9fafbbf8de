"""Multi-turn training on env=hotel, side by side at the same wall-clock budget (SmolLM2, 2 cores), four ways:

  (a) first-turn: the env written the documents' way (HotelSeedEnv: score_episode plays turns 2.. itself with
      model.generate) with runtime.train_env_calls=false: only the first reply is trained.
  (b) trajectory: the runtime generates every turn (HotelEnv.respond); every assistant turn is trained with the
      episode's advantage, the env's tokens masked.
  (c) seed-steps: HotelSeedEnv as written, runtime.train_env_calls=true (the default): every turn its own
      model.generate calls sampled is trained as a row of its own, with the episode's advantage.
  (d) turn-credit: (b) with runtime.turn_credit=turn: each turn its own advantage (HotelEnv.score_turn).
  booking-only: a diagnostic, not a mode of training: only the rows env.booking_starts adds (the right search and
      its listing given), in training and held out, so the run says whether the booking turn alone learns to read
      the wished feature (held-out requests: those whose listing has 2+ rooms; pass eval.num_prompts=24).

For each mode and seed: held-out (unique test requests, greedy episodes) mean reward, gain +- SE and success rate
before -> after, steps, seconds per step, the wait before the first training step,
how many held-out episodes booked the wished room where the search listed another first ("reads features", from
the ledger: "book the first listed" gets none, but another position may get them all; compare the run's success
with the scripted "best position per length", the most a policy blind to the features scores), and per step the env's own turns trained as rows of their own,
chained onto their episode's row, and rebased.

    .venv/bin/python scripts/bench/multiturn.py --seeds 0 1 2 --minutes 20
    .venv/bin/python scripts/bench/multiturn.py --modes trajectory seed-steps -- env.difficulty=easy
"""

import argparse
import functools
import json
import os
import statistics
import time
from pathlib import Path

import harness
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from grpo_pipeline.config import CONFIG_DIR
from grpo_pipeline.config.schema import register_configs
from grpo_pipeline.envs.hotel import HotelEnv, HotelSeedEnv, listed_ids, right_search, tool_call
from grpo_pipeline.recipe import _split, train
from grpo_pipeline.tracking import ledger
from grpo_pipeline.tracking.mlflow_run import default_tracking_uri, metric_history


class BookingOnly(HotelEnv):
    """A diagnostic, not a way to train: only env.booking_starts rows (the right search and its listing given), held
    out too, so the runs says whether the booking turn alone learns to read the wished feature."""

    def build_dataset(self, tokenizer):
        return super().build_dataset(tokenizer).filter(lambda row: row["starts_at"] == "booking")


MODES = {  # mode -> (env class, overrides)
    "first-turn": (HotelSeedEnv, ["runtime.train_env_calls=false"]),
    "trajectory": (HotelEnv, []),
    "seed-steps": (HotelSeedEnv, []),
    "turn-credit": (HotelEnv, ["runtime.turn_credit=turn"]),
    "booking-only": (BookingOnly, ["env.booking_starts=1.0"]),
}


def run(mode: str, seed: int, minutes: float, overrides: list[str], out: Path) -> dict:
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[
            "env=hotel", f"seed={seed}", f"training.max_minutes={minutes}", "training.max_steps=1000",
            # a step: 8 episodes (2 requests x 4), up to 3 turns of 64 tokens, as in issue 13
            "training.batch_size=8", "generation.oversample=1", "generation.max_new_tokens=64",
            "eval.every_steps=0", f"output_dir={out / f'{mode}-seed{seed}'}",
            # every run gets the same wall-clock budget and its held-out score after: a run that loses its signal
            # (flat groups) goes on training, instead of stopping before its "after" evaluation
            "training.no_signal.enabled=false",
            "tracking.experiment_name=bench_multiturn", *MODES[mode][1], *overrides])
    env_kwargs = {k: v for k, v in cfg.env.items() if k != "_target_"}
    env = MODES[mode][0](**env_kwargs)
    started = time.monotonic()
    r = train(cfg, launch_dir=os.getcwd(), overrides=[f"mode={mode}", f"seed={seed}", *overrides], env=env)
    wall = time.monotonic() - started
    history = functools.partial(metric_history, default_tracking_uri(os.getcwd()), r.mlflow_run_id)
    flat, turns = history("frac_reward_zero_std"), history("env/turn_samples")
    chained, rebased = history("env/turn_samples_chained"), history("env/turn_calls_rebased")
    return {"mode": mode, "seed": seed, "before": r.eval_before, "after": r.eval_after, "steps": r.steps,
            "reads_features": reads_features(env, Path(r.run_dir) / ledger.FILE),
            "train_reads": reads_features(env, Path(r.run_dir) / ledger.FILE, "train", r.steps * 2 // 3),
            "turn_rows": statistics.fmean(turns) if turns else None,
            "chained": statistics.fmean(chained) if chained else None,
            "rebased": statistics.fmean(rebased) if rebased else None,
            "flat_groups": statistics.fmean(flat) if flat else None,
            "s_per_step": r.train_seconds / max(r.steps, 1), "wait_before_first_step": r.startup_seconds,
            "rewards": r.rewards, "wall_s": wall}


def reads_features(env: HotelEnv, path: Path, split: str = "test_after", from_step: int = 0) -> tuple[int, int]:
    """Of the held-out episodes after training (or, with split="train", the training episodes from `from_step` on)
    whose search listed first a room that misses a wish while another listed room meets them all: how many booked a
    room meeting every wish (the first-listed shortcut books none; a policy that books the last room listed may book
    them all: compare its success with the scripted "last listed"). A booking start's listing is its opening's
    (env.booking_starts). A seed-style env's ledger keeps its first reply alone: the listing is the env's
    reply to it (the same order the episode saw: a search's order follows the call written)."""
    hard = right = 0
    for e in ledger.read(path):
        row = e.get("row") or {}
        request = row.get("request")
        if e["split"] != split or request is None or (e.get("step") or 0) < from_step:
            continue
        messages = e.get("messages") or [{"role": "assistant", "content": e["completion"]}]
        messages = [*env._given(request, row.get("starts_at", "request")), *messages]  # a booking start's listing
        tool = next((m for m in messages if m.get("role") == "tool"), None)
        if tool is None:  # a seed-style episode: the env's reply to its first turn
            tool = env.reply(messages[:1], request) or {}
        listed = [env.rooms[i] for i in listed_ids(tool.get("content")) if i in env.rooms]
        if not listed or env.fits(listed[0], request) or not any(env.fits(r, request) for r in listed):
            continue
        hard += 1
        right += e["reward"] == 1.0
    return right, hard


def scripted(cfg) -> dict[str, tuple[float, float]]:
    """Held-out (mean reward, success) of two scripted policies on the runs' test requests, scored by the env's own
    reward: what a learned policy's numbers mean. "first listed": search with the guest's city, guests and price cap,
    then book the first room the search lists (a positional shortcut, blind to the wished features; with
    env.shuffle_results=true, in the order this scripted call got); "last listed": the same, booking the last room
    listed (a learned policy may settle on that shortcut instead: seed 19, 2026-12-07 night, whose "reads features"
    count it fools); "best position per length": for each listing length, the one position that books the most of
these very test requests right (fitted on them: the most any policy blind to the wished features can score here; on
env=hotel's default 12 test requests, "the second of two, else the first" scores 11 of 12); "oracle": the same
search, then the first listed room that meets every wish. Only a run above "best position per length" shows reading."""
    env = HotelEnv(**{k: v for k, v in cfg.env.items() if k != "_target_"})
    test = _split(cfg, env, env.build_dataset(None)).test  # the run's own split (grouped by request, as training)
    episodes = []  # per test request: the right search, its listing, the rooms listed
    for request in test["request"]:
        messages = [{"role": "assistant", "content": right_search(request)}]
        messages.append(env.reply(messages, request))
        episodes.append((request, messages, [env.rooms[i] for i in listed_ids(messages[-1]["content"])]))

    def score(request, messages, room) -> float:
        booking = {"role": "assistant", "content": tool_call("book_room", {"room_id": room["room_id"]})}
        return env.score_episode(None, None, [*messages, booking], request)

    best_at = best_position_per_length(env, [(request, listed) for request, _, listed in episodes])
    scores: dict[str, list[float]] = {"first listed": [], "last listed": [], "best position per length": [],
                                      "oracle": []}
    for request, messages, listed in episodes:
        fits = [r for r in listed if env.fits(r, request)] or listed
        for name, room in (("first listed", listed[0]), ("last listed", listed[-1]),
                           ("best position per length", listed[best_at[len(listed)]]), ("oracle", fits[0])):
            scores[name].append(score(request, messages, room))
    return {name: (statistics.fmean(s), statistics.fmean(x == 1.0 for x in s)) for name, s in scores.items()}


def best_position_per_length(env: HotelEnv, cases: list[tuple[dict, list[dict]]]) -> dict[int, int]:
    """For each listing length among `cases` (request, rooms listed), the one position that books the most of those
    listings right: the rule a policy blind to the wished features scores best with on them."""
    best = {}
    for n in {len(listed) for _, listed in cases}:
        same = [(r, listed) for r, listed in cases if len(listed) == n]
        best[n] = max(range(n), key=lambda i: sum(env.fits(listed[i], r) for r, listed in same))
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--minutes", type=float, default=12.0, help="training wall-clock budget per run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    harness.threads(args.threads)
    register_configs()
    out = Path("outputs/bench_multiturn") / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        reference = scripted(compose("train", overrides=["env=hotel", *args.overrides]))
    rows = []
    for seed in args.seeds:
        for mode in args.modes:
            rows.append(run(mode, seed, args.minutes, args.overrides, out))
            (out / "results.json").write_text(json.dumps(rows, indent=1, default=str))
            report(rows, args, reference)


def report(rows: list[dict], args, reference: dict[str, tuple[float, float]]) -> None:
    print()
    harness.machine(f"{args.minutes:g} min of training per run; overrides {args.overrides}")
    table = harness.Table("mode      ", "seed", "mean reward", "gain (+- SE)", "success", "steps", "s/step",
                          "wall", "wait before step 1", "train reward first 3 -> last 3", "flat groups", "reads features", "train reads (last third)", "turn rows",
                          "chained", "rebased")
    for r in rows:
        b, a, curve = r["before"], r["after"], r["rewards"]
        table.row(r["mode"], r["seed"], f"{b['mean_reward']:.3f} -> {a['mean_reward']:.3f}",
                  f"{a['mean_reward'] - b['mean_reward']:+.3f} +- {a.get('gain_se') or 0:.3f}",
                  f"{b['success_rate']:.2f} -> {a['success_rate']:.2f}", r["steps"], f"{r['s_per_step']:.1f}",
                  f"{r['wall_s'] / 60:.1f} min", f"{r['wait_before_first_step']:.0f} s",
                  f"{statistics.fmean(curve[:3]):.3f} -> {statistics.fmean(curve[-3:]):.3f}",
                  f"{r['flat_groups'] or 0:.2f}", "{}/{}".format(*r["reads_features"]), "{}/{}".format(*r.get("train_reads", (0, 0))), *(f"{r[k]:.1f}" if r.get(k) is not None else "-" for k in ("turn_rows", "chained", "rebased")))
    for mode in args.modes:
        mine = [r for r in rows if r["mode"] == mode]
        if mine:
            lifts = [r["after"]["success_rate"] - r["before"]["success_rate"] for r in mine]
            after = [r["after"]["success_rate"] for r in mine]
            spread = f", std {statistics.stdev(after):.3f}" if len(after) > 1 else ""
            print(f"{mode}: success after mean {statistics.fmean(after):.3f}{spread}, min {min(after):.3f}; "
                  f"lift mean {statistics.fmean(lifts):+.3f}, min {min(lifts):+.3f}; "
                  f"s/step mean {statistics.fmean(r['s_per_step'] for r in mine):.1f}")
    for name, (mean, success) in reference.items():
        print(f"scripted, {name}: held-out mean reward {mean:.3f}, success {success:.2f}")


if __name__ == "__main__":
    main()
