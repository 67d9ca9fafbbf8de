"""What a run leaves behind: its result (summary.json), the reward plot, and its name and description in MLflow."""

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from grpo_pipeline.tracking.mlflow_run import Tracker, TrackingError
from grpo_pipeline.tracking.redact import mask_override, mask_secrets
from grpo_pipeline.training.checkpoints import write_durably

log = logging.getLogger(__name__)
EVAL_REWARD = {"env": "eval.reward=env: the env's score alone",
               "total": "eval.reward=total: the reward training sums"}


@dataclass(eq=False)
class RunResult(Mapping):
    """A run's result: attributes (result.model_path) and, as in the seed documents' API, a read-only mapping
    (result["model_path"], dict(result), "eval_after" in result)."""

    run_dir: str
    model_path: str | None
    num_samples: int
    num_epochs: float
    steps: int
    first_reward: float | None
    last_reward: float | None
    average_reward: float | None
    eval_before: dict | None  # test set, before training
    eval_after: dict | None  # test set, after training: the weights in model_path (step model_step)
    mlflow_run_id: str | None
    wall_time_s: float
    train_seconds: float
    rewards: list[float]
    best_step: int | None = None  # the step with the highest validation mean reward
    best_val: float | None = None  # its validation mean reward
    model_step: int | None = None  # the step whose weights are in model/: best_step if it clearly beat the last
    last_step: int | None = None
    last_val: float | None = None  # the last validation's mean reward (weights in model-last/)
    validation: list | None = None  # [(step, validation mean reward), ...]
    stopped_early: bool = False
    eval_seconds: float = 0.0  # time spent on validation during training
    startup_seconds: float = 0.0  # from the start to the first training step (loading, the "before" evaluation)
    ledger_seconds: float = 0.0  # time spent writing the episode ledger
    eval_reward: str | None = None  # what the held-out scores are: env | total (eval.reward); None: no held-out set
    mlflow_ui: dict | None = None  # the MLflow UI's pages of the run (tracking/mlflow_run.ui_links)

    def __getitem__(self, key: str) -> Any:
        if key not in self._keys():
            raise KeyError(f"{key!r}: a run result has {', '.join(self._keys())}")
        return getattr(self, key)

    def __iter__(self):
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def _keys(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self))

    def summary(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "rewards"} | {"reward_curve": self.rewards}


def end_lines(result: RunResult) -> str:
    """What a run prints at its end: where its files are and its pages in the MLflow UI."""
    lines = [f"Run dir: {result.run_dir}", f"Summary: {result.run_dir}/summary.json"]
    ui = result.mlflow_ui
    if ui:
        lines.append(f"MLflow UI (serve it with: {ui['serve']}):" if ui["serve"] else "MLflow UI:")
        lines += [f"  the experiment's runs: {ui['experiment_runs']}", f"  this run:              {ui['run']}"]
    return "\n".join(lines)


def log_eval(tracker: Tracker, prefix: str, metrics: dict, step: int, now: bool = False) -> None:
    scored_by = EVAL_REWARD[metrics.get("reward", "env")]
    log.warning("%s: mean reward %.3f, success rate %.3f over %d held-out prompts (%s)%s",
                prefix, metrics["mean_reward"], metrics["success_rate"], metrics["num_prompts"], scored_by,
                f" ({metrics['failures']} failed)" if metrics.get("failures") else "")
    values = {f"{prefix}/mean_reward": metrics["mean_reward"], f"{prefix}/success_rate": metrics["success_rate"],
              f"{prefix}/failures": float(metrics.get("failures", 0))}
    if "gain" in metrics:  # after training, with the test scored before (a resumed run: by its first start)
        se = metrics["gain_se"]
        log.warning("%s: held-out gain %+.3f %s (mean per-prompt change over %d prompts)", prefix, metrics["gain"],
                    "(one prompt: no standard error)" if se is None else f"+- {se:.3f} (its standard error)",
                    metrics["num_prompts"])
        values |= {f"{prefix}/gain": metrics["gain"]} | ({f"{prefix}/gain_se": se} if se is not None else {})
    (tracker.log_now if now else tracker.log_metrics)(values, step=step)


def write_outputs(result: RunResult, run_dir: Path, tracker: Tracker) -> None:
    from grpo_pipeline.tracking.plots import plot_rewards

    write_durably(run_dir / "summary.json", mask_secrets(json.dumps(result.summary(), indent=2)))
    if result.rewards:
        plot_rewards(result.rewards, run_dir / "reward_curve.png", result.eval_before, result.eval_after,
                     result.validation, result.model_step)
    try:  # the run's results are on disk: a store that fails now costs the copy in MLflow, not the run
        if result.best_step is not None:
            tracker.set_tag("best_step", str(result.best_step))
            tracker.set_tag("model_step", str(result.model_step))
            tracker.log_metrics({"best/val_mean_reward": result.best_val, "best/step": float(result.best_step),
                                 "last/val_mean_reward": result.last_val, "model/step": float(result.model_step)},
                                step=result.steps)
        plans = sorted(p.name for p in run_dir.glob("plan-step*.json"))
        for name in ("summary.json", "resolved_config.yaml", "reward_curve.png", "plan.json", *plans):
            tracker.log_artifact(run_dir / name)
    except TrackingError as e:
        log.warning("%s. The run finished and its outputs are in %s; only MLflow's copy of them is missing.",
                    e, run_dir)


def description(cfg, env_name: str, overrides: list[str] | None) -> str:
    """The run's description in the MLflow UI: what was trained, on what, how."""
    adapter = f"LoRA r={cfg.lora.r}" if cfg.lora.enabled else "full fine-tuning"
    steps = f"{cfg.training.max_steps} steps" if cfg.training.max_steps > 0 else f"{cfg.training.num_epochs:g} epochs"
    text = (f"GRPO ({cfg.loss.loss_type}, kl_coef {cfg.loss.kl_coef:g}) of {cfg.model.name} on {env_name}: {adapter}, "
            f"{steps}, lr {cfg.training.learning_rate:g}, {cfg.generation.num_generations} completions per prompt, "
            f"{cfg.training.batch_size} per step, up to {cfg.generation.max_new_tokens} new tokens, seed {cfg.seed}.")
    if overrides:
        text += "\n\nOverrides: " + " ".join(mask_override(o) for o in overrides)
    return mask_secrets(text)


def run_name(cfg, env_name: str, overrides: list[str] | None) -> str:
    if overrides:
        return mask_secrets(",".join(mask_override(o) for o in overrides))[:200]
    return f"{cfg.model.name}-{env_name}-{cfg.loss.loss_type}"
