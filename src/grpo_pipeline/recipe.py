"""The GRPO recipe, top to bottom: validate -> env -> dataset -> rewards -> trainer -> train -> save -> log.

Everything up to `_build_trainer` is cheap and checks the config, the env class and its dataset, so a
bad config fails in seconds, before weights load and before an MLflow run exists. After that:
- an error marks the MLflow run FAILED and saves what was trained to `<run dir>/model-interrupted`;
- SIGINT/SIGTERM finish the step, save a checkpoint, mark the run KILLED and stop;
- `resume=<run dir>` (or `resume=auto`) continues from the latest checkpoint in the same MLflow run.
Under `accelerate launch` every process trains; only the main one tracks, evaluates and writes files.
"""

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from grpo_pipeline.callbacks import RunLogger, StopControl
from grpo_pipeline.checkpoints import RUN_ID_FILE, TrainingStopped, remove_incomplete, resolve_resume
from grpo_pipeline.config.validate import check_config
from grpo_pipeline.envs.loader import build_env_dataset, get_tool_functions, get_tool_schemas, load_env
from grpo_pipeline.evaluation import evaluate, split_heldout
from grpo_pipeline.models import load_model, load_tokenizer, lora_target_modules, model_type
from grpo_pipeline.prompts import attach_tools
from grpo_pipeline.redact import mask_credentials, redact_log_records
from grpo_pipeline.rewards import build_rewards
from grpo_pipeline.runtime.episodes import EpisodeRunner
from grpo_pipeline.tracking import Tracker, TrackingError, flatten

log = logging.getLogger(__name__)
UNSENT_FILE = "metrics_unsent.jsonl"  # metrics a store that stayed down never got


@dataclass
class RunResult:
    run_dir: str
    model_path: str | None
    num_samples: int
    num_epochs: float
    steps: int
    first_reward: float | None
    last_reward: float | None
    average_reward: float | None
    eval_before: dict | None
    eval_after: dict | None
    mlflow_run_id: str | None
    wall_time_s: float
    train_seconds: float
    rewards: list[float]

    def summary(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "rewards"} | {"reward_curve": self.rewards}


def train(cfg: DictConfig, launch_dir: str | None = None, overrides: list[str] | None = None,
          env: Any = None, tags: dict[str, str] | None = None) -> RunResult:
    """Run one GRPO training. `env` may be an env class or instance (instead of `env._target_`)."""
    started = time.monotonic()
    redact_log_records()
    launch_dir = launch_dir or os.getcwd()
    is_main = int(os.environ.get("RANK", "0")) == 0

    # 1. Everything that can be checked without weights.
    check_config(cfg)
    run_dir, checkpoint = resolve_resume(cfg.resume, cfg.output_dir)
    env, tokenizer, dataset, tool_functions = load_env_and_dataset(cfg, env)
    env_name = type(env).__qualname__
    heldout = None
    if cfg.eval.enabled:
        dataset, heldout = split_heldout(dataset, cfg.eval.num_prompts, cfg.eval.split_seed)
    runner = EpisodeRunner(env, tokenizer, cfg.runtime, [c for c in dataset.column_names if c != "prompt"])
    lora_targets = lora_target_modules(model_type(cfg.model), cfg.lora.target_modules) if cfg.lora.enabled else None
    reward_funcs, reward_weights = build_rewards(cfg.reward, runner.reward_function(), dataset.column_names)
    from grpo_pipeline.config.grpo_args import build_grpo_config  # imports TRL: after the cheap checks

    grpo_config = build_grpo_config(cfg, str(run_dir / "checkpoints"), reward_weights)
    tracker = Tracker(cfg.tracking, launch_dir, enabled=is_main)

    # 2. The run.
    run_dir.mkdir(parents=True, exist_ok=True)
    if checkpoint is not None and is_main:
        remove_incomplete(run_dir)
    if checkpoint is not None and (run_dir / RUN_ID_FILE).exists():
        tracker.resume((run_dir / RUN_ID_FILE).read_text().strip(), checkpoint)
        log.warning("Resuming %s from %s", run_dir, checkpoint.name)
    else:
        run_name = cfg.tracking.run_name or _run_name(cfg, env_name, overrides)
        all_tags = {"env": env_name, "model": cfg.model.name, "overrides": " ".join(overrides or [])}
        tracker.start(run_name, flatten(OmegaConf.to_container(cfg, resolve=True)), all_tags | (tags or {}),
                      description=_description(cfg, env_name, overrides))
        if is_main and tracker.run_id:
            (run_dir / RUN_ID_FILE).write_text(tracker.run_id)
    if is_main:
        (run_dir / "resolved_config.yaml").write_text(mask_credentials(OmegaConf.to_yaml(cfg, resolve=True)))
    trainer = None
    stop = StopControl(tracker)
    try:
        trainer = _build_trainer(cfg, tokenizer, dataset, reward_funcs, grpo_config, tracker, lora_targets, stop,
                                 tool_functions)
        policy = trainer.accelerator.unwrap_model(trainer.model)
        runner.bind(policy)
        eval_tokens = cfg.eval.max_new_tokens or cfg.generation.max_new_tokens
        eval_before = eval_after = None
        if heldout is not None and cfg.eval.before and checkpoint is None and is_main:
            eval_before = evaluate(policy, tokenizer, runner, heldout, eval_tokens, cfg.eval.batch_size)
            _log_eval(tracker, "eval_before", eval_before, step=0, now=True)  # a resumed run never repeats it
        train_started = time.monotonic()
        stop.install()
        try:
            trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
        finally:
            stop.uninstall()
        train_seconds = time.monotonic() - train_started
        if stop.signum is not None or stop.reason is not None:
            why = f"by signal {stop.signum}" if stop.signum is not None else f"because {stop.reason}"
            raise TrainingStopped(
                f"Stopped {why} at step {trainer.state.global_step}; a checkpoint was saved in "
                f"{run_dir / 'checkpoints'}. Continue with: resume={run_dir}",
                128 + stop.signum if stop.signum is not None else 3)
        model_path = _save(trainer, tokenizer, run_dir) if cfg.training.save_model else None
        if heldout is not None and cfg.eval.after and is_main:
            eval_after = evaluate(policy, tokenizer, runner, heldout, eval_tokens, cfg.eval.batch_size)
            _log_eval(tracker, "eval_after", eval_after, step=trainer.state.global_step)
        if cfg.lora.enabled and cfg.lora.save_merged and model_path and is_main:
            merged = trainer.model.merge_and_unload()
            merged.save_pretrained(run_dir / "model_merged")
            tokenizer.save_pretrained(run_dir / "model_merged")
        rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
        result = RunResult(
            run_dir=str(run_dir),
            model_path=model_path,
            num_samples=len(dataset),
            num_epochs=float(trainer.state.epoch or 0.0),
            steps=trainer.state.global_step,
            first_reward=rewards[0] if rewards else None,
            last_reward=rewards[-1] if rewards else None,
            average_reward=sum(rewards) / len(rewards) if rewards else None,
            eval_before=eval_before,
            eval_after=eval_after,
            mlflow_run_id=tracker.run_id,
            wall_time_s=round(time.monotonic() - started, 1),
            train_seconds=round(train_seconds, 2),
            rewards=rewards,
        )
        if is_main:
            _write_outputs(result, run_dir, tracker)
        tracker.end("FINISHED", unsent_path=run_dir / UNSENT_FILE)
        return result
    except BaseException as e:
        if trainer is not None and trainer.state.global_step > 0 and not isinstance(e, TrainingStopped):
            _save_interrupted(trainer, run_dir)
        stopped = isinstance(e, KeyboardInterrupt | TrainingStopped) and stop.reason is None
        try:
            tracker.set_tag("error", (str(e) or e.__class__.__name__).splitlines()[0][:500])
        except TrackingError:
            pass
        tracker.end("KILLED" if stopped else "FAILED", unsent_path=run_dir / UNSENT_FILE)
        raise


def load_env_and_dataset(cfg: DictConfig, env: Any = None) -> tuple[Any, Any, Any, list]:
    """The env, the tokenizer (no weights), the checked dataset and the env's tool functions."""
    env = load_env(OmegaConf.to_container(cfg.env, resolve=True), env)
    tokenizer = load_tokenizer(cfg.model)
    tool_functions = get_tool_functions(env, tokenizer)
    dataset = build_env_dataset(env, tokenizer)
    if not tool_functions:  # with tool functions TRL renders the prompts with their schemas itself
        dataset = attach_tools(dataset, tokenizer, get_tool_schemas(env), type(env).__qualname__)
    return env, tokenizer, dataset, tool_functions


def _build_trainer(cfg, tokenizer, dataset, reward_funcs, grpo_config, tracker, lora_targets, stop, tools):
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOTrainer

    model = load_model(cfg.model, tokenizer)
    peft_config = None
    if cfg.lora.enabled:
        from peft import LoraConfig

        peft_config = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                                 target_modules=lora_targets, task_type="CAUSAL_LM")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=grpo_config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[RunLogger(tracker), stop],
        tools=tools or None,
    )
    trainer.remove_callback(PrinterCallback)  # RunLogger prints one readable line per step instead
    return trainer


def _save(trainer, tokenizer, run_dir: Path) -> str:
    path = run_dir / "model"
    trainer.save_model(str(path))  # the LoRA adapter when lora.enabled, else the full weights
    tokenizer.save_pretrained(path)
    return str(path)


def _save_interrupted(trainer, run_dir: Path) -> None:
    path = run_dir / "model-interrupted"
    try:
        trainer.save_model(str(path))
        log.error("Training stopped at step %d; what was trained so far is in %s", trainer.state.global_step, path)
    except Exception:  # saving must not hide the original error
        log.exception("Could not save the interrupted model to %s", path)


def _log_eval(tracker: Tracker, prefix: str, metrics: dict, step: int, now: bool = False) -> None:
    log.warning("%s: mean reward %.3f, success rate %.3f over %d held-out prompts",
                prefix, metrics["mean_reward"], metrics["success_rate"], metrics["num_prompts"])
    values = {f"{prefix}/mean_reward": metrics["mean_reward"], f"{prefix}/success_rate": metrics["success_rate"]}
    (tracker.log_now if now else tracker.log_metrics)(values, step=step)


def _write_outputs(result: RunResult, run_dir: Path, tracker: Tracker) -> None:
    from grpo_pipeline.plots import plot_rewards

    (run_dir / "summary.json").write_text(json.dumps(result.summary(), indent=2))
    if result.rewards:
        plot_rewards(result.rewards, run_dir / "reward_curve.png", result.eval_before, result.eval_after)
    for name in ("summary.json", "resolved_config.yaml", "reward_curve.png"):
        tracker.log_artifact(run_dir / name)


def _description(cfg, env_name: str, overrides: list[str] | None) -> str:
    """The run's description in the MLflow UI: what was trained, on what, how."""
    adapter = f"LoRA r={cfg.lora.r}" if cfg.lora.enabled else "full fine-tuning"
    steps = f"{cfg.training.max_steps} steps" if cfg.training.max_steps > 0 else f"{cfg.training.num_epochs:g} epochs"
    text = (f"GRPO ({cfg.loss.loss_type}, kl_coef {cfg.loss.kl_coef:g}) of {cfg.model.name} on {env_name}: {adapter}, "
            f"{steps}, lr {cfg.training.learning_rate:g}, {cfg.generation.num_generations} completions per prompt, "
            f"{cfg.training.batch_size} per step, up to {cfg.generation.max_new_tokens} new tokens, seed {cfg.seed}.")
    if overrides:
        text += "\n\nOverrides: " + " ".join(overrides)
    return mask_credentials(text)


def _run_name(cfg, env_name: str, overrides: list[str] | None) -> str:
    if overrides:
        return ",".join(overrides)[:200]
    return f"{cfg.model.name}-{env_name}-{cfg.loss.loss_type}"
