"""Multi-turn training on env=hotel, side by side at the same wall-clock budget (SmolLM2, 2 cores):

  (a) first-turn: yesterday's design. TRL samples and trains the first assistant reply only; score_episode
      plays the later turns itself with model.generate (no gradient) and credits the whole episode to turn 1.
  (b) trajectory: the runtime generates every turn (HotelEnv.respond); every assistant turn is trained, the
      env's tokens are masked.

For each mode and seed: held-out (unique test requests, greedy episodes) mean reward and success rate
before -> after, steps, seconds per step, and the wait before the first training step.

    .venv/bin/python scripts/bench/multiturn.py --seeds 0 1 --minutes 12
    .venv/bin/python scripts/bench/multiturn.py --modes trajectory -- env.difficulty=easy
"""

import argparse
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
from grpo_pipeline.envs.hotel import HotelEnv
from grpo_pipeline.prompts import render_prompt
from grpo_pipeline.recipe import train
from grpo_pipeline.tracking.mlflow_run import default_tracking_uri, metric_history


class FirstTurnHotel(HotelEnv):
    """(a): no `respond`, so TRL generates (and trains) only the first reply; the later turns are played here."""

    respond = None

    def score_episode(self, model, tokenizer, completion, request, **_):
        opening = self._opening(request)
        messages = opening + [{"role": "assistant", "content": completion}]
        for _turn in range(1, self.max_turns):
            reply = HotelEnv.respond(self, messages, request)
            if reply is None:
                break
            messages.append(reply)
            text, _ = render_prompt(tokenizer, messages)
            inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False).to(model.device)
            out = model.generate(**inputs, max_new_tokens=self.turn_max_new_tokens, pad_token_id=tokenizer.pad_token_id)
            messages.append({"role": "assistant",
                             "content": tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)})
        return HotelEnv.score_episode(self, model, tokenizer, messages[len(opening):], request)


MODES = {"first-turn": FirstTurnHotel, "trajectory": HotelEnv}


def run(mode: str, seed: int, minutes: float, overrides: list[str], out: Path) -> dict:
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[
            "env=hotel", f"seed={seed}", f"training.max_minutes={minutes}", "training.max_steps=1000",
            # a step: 8 episodes (2 requests x 4), up to 3 turns of 64 tokens, as in issue 13
            "training.batch_size=8", "generation.oversample=1", "generation.max_new_tokens=64",
            "eval.every_steps=0", f"output_dir={out / f'{mode}-seed{seed}'}",
            "tracking.experiment_name=bench_multiturn", *overrides])
    env_kwargs = {k: v for k, v in cfg.env.items() if k != "_target_"}
    started = time.monotonic()
    r = train(cfg, launch_dir=os.getcwd(), overrides=[f"mode={mode}", f"seed={seed}", *overrides],
              env=MODES[mode](**env_kwargs))
    wall = time.monotonic() - started
    flat = metric_history(default_tracking_uri(os.getcwd()), r.mlflow_run_id, "frac_reward_zero_std")
    return {"mode": mode, "seed": seed, "before": r.eval_before, "after": r.eval_after, "steps": r.steps,
            "flat_groups": statistics.fmean(flat) if flat else None,
            "s_per_step": r.train_seconds / max(r.steps, 1), "wait_before_first_step": r.startup_seconds,
            "rewards": r.rewards, "wall_s": wall}


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
    rows = []
    for seed in args.seeds:
        for mode in args.modes:
            rows.append(run(mode, seed, args.minutes, args.overrides, out))
            (out / "results.json").write_text(json.dumps(rows, indent=1, default=str))
            report(rows, args)


def report(rows: list[dict], args) -> None:
    print()
    harness.machine(f"{args.minutes:g} min of training per run; overrides {args.overrides}")
    table = harness.Table("mode      ", "seed", "mean reward", "success", "steps", "s/step", "wait before step 1",
                          "train reward first 3 -> last 3", "flat groups")
    for r in rows:
        b, a, curve = r["before"], r["after"], r["rewards"]
        table.row(r["mode"], r["seed"], f"{b['mean_reward']:.3f} -> {a['mean_reward']:.3f}",
                  f"{b['success_rate']:.2f} -> {a['success_rate']:.2f}", r["steps"], f"{r['s_per_step']:.1f}",
                  f"{r['wait_before_first_step']:.0f} s",
                  f"{statistics.fmean(curve[:3]):.3f} -> {statistics.fmean(curve[-3:]):.3f}",
                  f"{r['flat_groups'] or 0:.2f}")
    for mode in args.modes:
        lifts = [r["after"]["success_rate"] - r["before"]["success_rate"] for r in rows if r["mode"] == mode]
        if lifts:
            print(f"{mode}: success-rate lift mean {statistics.fmean(lifts):+.3f}, min {min(lifts):+.3f}")


if __name__ == "__main__":
    main()
