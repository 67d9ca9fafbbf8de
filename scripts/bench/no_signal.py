"""Would training.no_signal have stopped these runs? Replays the rule on runs already in an MLflow store.

For every finished run of the given experiments: its logged `frac_reward_zero_std`, `reward` and `entropy` per step,
fed step by step to the rule with the settings given (default: the config's defaults), and the step it would have
stopped at (or "never"), with the highest flat share over any window the rule looks at. No training runs here.

    .venv/bin/python scripts/bench/no_signal.py --experiments bench_learning grpo_pipeline bench_multiturn
    .venv/bin/python scripts/bench/no_signal.py --patience 10 --min-entropy 0.01
"""

import argparse
import os

import harness

from grpo_pipeline.config.schema import NoSignalConfig
from grpo_pipeline.tracking.mlflow_run import default_tracking_uri, metric_history
from grpo_pipeline.training.callbacks import NoSignalGuard, StopControl


def replay(flat: list[float], reward: list[float], entropy: list[float], groups_per_step: int, cfg) -> tuple:
    """(step it stops at or None, its diagnosis, the highest window flat share seen): the run's logs fed to the
    training callback itself, step by step."""
    from transformers import TrainerControl, TrainerState

    guard = NoSignalGuard(StopControl(), cfg.flat_share, cfg.patience, cfg.min_groups, cfg.min_entropy, groups_per_step)
    state, worst = TrainerState(), 0.0
    for i, f in enumerate(flat):
        state.global_step = i + 1
        logs = {"frac_reward_zero_std": f, "reward": reward[i] if i < len(reward) else None,
                "entropy": entropy[i] if i < len(entropy) else None}
        guard.on_log(None, state, TrainerControl(), logs)
        if len(guard.steps) >= cfg.patience:
            worst = max(worst, sum(s[0] for s in guard.steps) / len(guard.steps))
        if guard.diagnosis:
            return i + 1, guard.diagnosis, worst
    return None, None, worst


def main() -> None:
    defaults = NoSignalConfig()
    parser = argparse.ArgumentParser()
    parser.add_argument("--experiments", nargs="+", default=["bench_learning", "grpo_pipeline", "bench_multiturn"])
    parser.add_argument("--tracking-uri", default=default_tracking_uri(os.getcwd()))
    parser.add_argument("--flat-share", type=float, default=defaults.flat_share)
    parser.add_argument("--patience", type=int, default=defaults.patience)
    parser.add_argument("--min-groups", type=int, default=defaults.min_groups)
    parser.add_argument("--min-entropy", type=float, default=defaults.min_entropy)
    args = parser.parse_args()
    cfg = NoSignalConfig(True, args.flat_share, args.patience, args.min_groups, args.min_entropy)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(args.tracking_uri)
    harness.machine(f"replaying training.no_signal={cfg} on {args.tracking_uri}")
    table = harness.Table("experiment", "run", "env", "steps", "groups/step", "max window flat share", "min entropy",
                          "stops at")
    for name in args.experiments:
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            continue
        for run in client.search_runs([experiment.experiment_id], "attributes.status = 'FINISHED'"):
            params = run.data.params
            flat = metric_history(args.tracking_uri, run.info.run_id, "frac_reward_zero_std")
            if not flat:
                continue
            entropy = metric_history(args.tracking_uri, run.info.run_id, "entropy")
            reward = metric_history(args.tracking_uri, run.info.run_id, "reward")
            completions = int(params.get("training.batch_size", 8)) * int(params.get("generation.oversample", 1) or 1)
            groups = max(1, completions // int(params.get("generation.num_generations", 4)))
            stop, said, worst = replay(flat, reward, entropy, groups, cfg)
            table.row(name, (run.info.run_name or run.info.run_id)[:40], params.get("env._target_", "?").split(".")[-1],
                      len(flat), groups, f"{worst:.2f}", f"{min(entropy):.4f}" if entropy else "-",
                      f"step {stop}" if stop else "never")
            if said:
                print(f"    {run.info.run_id[:8]}: {said[:200]}")


if __name__ == "__main__":
    main()
