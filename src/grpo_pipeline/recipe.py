"""The GRPO recipe, top to bottom: validate -> env -> dataset -> rewards -> trainer -> train -> save -> log.

Everything up to `_build_trainer` is cheap and checks the config, the env class and its dataset, so a
bad config fails in seconds, before weights load and before an MLflow run exists. After that:
- an error marks the MLflow run FAILED and saves what was trained to `<run dir>/model-interrupted`;
- SIGINT/SIGTERM finish the step, save a checkpoint, mark the run KILLED and stop;
- `resume=<run dir>` (or `resume=auto`) continues from the latest checkpoint in the same MLflow run.
With `eval.every_steps`, a validation set is scored during training and `model/` gets the best step's
weights if they clearly beat the last ones (`eval.best_margin`), else the last (`model-last/` always the
last); the test set is scored only before and after.
Under several processes every process trains; only the main one tracks, evaluates and writes files.
"""

import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from grpo_pipeline.config.plan import PLAN_FILE, make_plan
from grpo_pipeline.config.validate import check_config
from grpo_pipeline.envs.loader import (
    build_env_dataset,
    get_tool_functions,
    get_tool_schemas,
    importable_from,
    load_env,
)
from grpo_pipeline.envs.runner import EpisodeRunner
from grpo_pipeline.errors import ConfigError
from grpo_pipeline.evaluation.heldout import Split, evaluate, paired_gain, split_heldout
from grpo_pipeline.models import load_model, load_tokenizer, lora_target_modules, model_type
from grpo_pipeline.prompts import attach_tools
from grpo_pipeline.rewards.assemble import build_rewards
from grpo_pipeline.rollout.turns import make_rollout
from grpo_pipeline.tracking.ledger import heldout_scores
from grpo_pipeline.tracking.mlflow_run import Tracker, TrackingError, flatten
from grpo_pipeline.tracking.outputs import (
    RunResult,
    description,
    log_eval,
    run_name,
    write_outputs,
)
from grpo_pipeline.tracking.redact import mask_override, masked_config, redact_log_records, register_config
from grpo_pipeline.training.callbacks import Diverged, DivergenceGuard, RunLogger, StopControl, finite
from grpo_pipeline.training.checkpoints import (
    RUN_ID_FILE,
    CheckpointMarker,
    TrainingStopped,
    first_loadable,
    remove_incomplete,
    replace_dir_durably,
)
from grpo_pipeline.training.run_dir import check_changes, claim, record_changes, resume_command, write_record

log = logging.getLogger(__name__)
UNSENT_FILE = "metrics_unsent.jsonl"  # metrics a store that stayed down never got

__all__ = ["RunResult", "train", "load_env_and_dataset"]


def train(cfg: DictConfig, launch_dir: str | None = None, overrides: list[str] | None = None,
          env: Any = None, tags: dict[str, str] | None = None) -> RunResult:
    """Run one GRPO training. `env` may be an env class or instance (instead of `env._target_`)."""
    started = time.monotonic()
    redact_log_records()
    register_config(cfg)  # secret values are masked in everything the run writes; the env gets the real ones
    launch_dir = launch_dir or os.getcwd()
    is_main = int(os.environ.get("RANK", "0")) == 0

    # 1. Everything that can be checked without weights.
    check_config(cfg)
    run_dir = Path(cfg.output_dir if cfg.resume in (None, "auto") else cfg.resume)
    record, checkpoints = claim(run_dir, cfg.resume, main=is_main)  # one run per run dir; only its own checkpoints
    changes = check_changes(run_dir, masked_config(cfg), list(cfg.resume_allow)) if record else {}
    checkpoint = first_loadable(checkpoints)  # the newest that loads; a resume with none that loads is an error
    if checkpoints and checkpoint is None:
        raise ConfigError(f"resume={cfg.resume}: none of the run's checkpoints "
                          f"({', '.join(p.name for p in checkpoints)}) loads (see the warnings above).")
    env, tokenizer, dataset, tool_functions = load_env_and_dataset(cfg, env, launch_dir, render_tools=False)
    env_name = type(env).__qualname__
    split = _split(cfg, env, dataset)
    plan = make_plan(cfg, env, tokenizer, split, tool_functions, env_name)  # every choice, once (config/plan.py)
    if is_main:
        log.warning("%s", plan.table())
    given, cfg = cfg, plan.applied(cfg)  # the run's config: the step fitted to the data; the one given is kept
    gen = cfg.generation
    extra_columns = [c for c in dataset.column_names if c != "prompt"]
    runner = EpisodeRunner(env, tokenizer, cfg.runtime, extra_columns, sampling=sampling(gen),
                           group_size=gen.num_generations)
    rollout = make_rollout(cfg, plan, env, tokenizer, runner)  # None: TRL generates
    if rollout is not None and rollout.multi_turn:
        rollout.check_template(dataset[0]["prompt"], cfg.model.name)  # at startup, not at the first env turn
    if rollout is not None and rollout.uses_vllm:
        _check_fits_vllm(cfg, rollout, dataset, env_name)
    if rollout is None and not tool_functions:  # TRL renders chat prompts without tools: give it text
        split = Split(*(attach_tools(d, tokenizer, get_tool_schemas(env), env_name) if d is not None else None
                        for d in (split.train, split.test, split.val)))
    lora_targets = lora_target_modules(model_type(cfg.model), cfg.lora.target_modules) if cfg.lora.enabled else None
    with importable_from(launch_dir):  # reward components may live in the launch dir, like the env
        reward_funcs, reward_weights = build_rewards(cfg.reward, runner.reward_function(), dataset.column_names)
    from grpo_pipeline.config.grpo_args import build_grpo_config  # imports TRL: after the cheap checks

    grpo_config = build_grpo_config(cfg, str(run_dir / "checkpoints"), reward_weights, bool(tool_functions),
                                    use_vllm=not plan.runtime_generates and cfg.vllm.mode != "off")
    tracker = Tracker(cfg.tracking, launch_dir, enabled=is_main,
                      uri=(record or {}).get("tracking_uri"))  # a resume writes to the store the run started in
    run_uid = record["uid"] if record else uuid.uuid4().hex[:12]

    # 2. The run.
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = None
    stop = StopControl(tracker, max_minutes=cfg.training.max_minutes)
    guard = DivergenceGuard(cfg.training.learning_rate)
    try:
        stop.install()  # from here on SIGINT/SIGTERM end the run cleanly (after the current step, in training)
        _open_run(given, plan, tracker, run_dir, checkpoint, env_name, overrides, tags, is_main, run_uid, launch_dir)
        ledger = _open_ledger(cfg, run_dir, tokenizer, checkpoint) if is_main else None
        trainer = _build_trainer(cfg, tokenizer, split.train, reward_funcs, grpo_config, tracker, lora_targets,
                                 tool_functions, rollout, extra_columns, ledger)
        trainer.add_callback(CheckpointMarker(run_uid, cfg.training.save_total_limit))
        trainer.add_callback(guard)
        if checkpoint is not None and is_main:
            record_changes(run_dir, _step_of(checkpoint), changes, tracker)
        policy = trainer.accelerator.unwrap_model(trainer.model)
        runner.bind(policy)
        eval_tokens = cfg.eval.max_new_tokens or gen.max_new_tokens

        def score(dataset, split_name: str, step: int) -> dict:
            result = evaluate(policy, tokenizer, runner, dataset, eval_tokens, cfg.eval.batch_size, rollout,
                              cap_turn_tokens=cfg.eval.max_new_tokens)
            episodes = result.pop("episodes", None)
            if ledger is not None and episodes is not None:
                ledger.record(split_name, step, episodes["prompts"], episodes["completions"],
                              {"env": episodes["scores"]}, rows=episodes["rows"], seconds=episodes["seconds"],
                              failures=episodes["failures"], transcripts=bool(rollout and rollout.multi_turn))
            return result

        validation = _add_validation(cfg, trainer, stop, score, split, run_dir, policy, tracker, checkpoint, is_main)
        trainer.add_callback(stop)  # after validation: an early stop is decided in the same step
        eval_before = eval_after = None
        if split.test is not None and cfg.eval.before and checkpoint is None and is_main:
            eval_before = score(split.test, "test_before", 0)
            log_eval(tracker, "eval_before", eval_before, step=0, now=True)  # a resumed run never repeats it
        if stop.signum is not None:
            raise TrainingStopped(f"Stopped by signal {stop.signum} before training started; nothing was trained.",
                                  128 + stop.signum)
        train_started = time.monotonic()
        trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
        train_seconds = time.monotonic() - train_started
        completed = trainer.state.global_step >= trainer.state.max_steps or stop.stopped_early
        if stop.reason is not None or (stop.signum is not None and not completed):
            why = f"by signal {stop.signum}" if stop.signum is not None else f"because {stop.reason}"
            raise TrainingStopped(
                f"Stopped {why} at step {trainer.state.global_step}; a checkpoint was saved in "
                f"{run_dir / 'checkpoints'}. Continue with:\n  {resume_command(run_dir)}",
                128 + stop.signum if stop.signum is not None else 3)
        if validation is not None and validation.last_step != trainer.state.global_step:
            validation.validate(trainer.state)  # stopped between validations (max_minutes): score the live weights
        model_path = _save_models(cfg, trainer, tokenizer, run_dir, validation) if cfg.training.save_model else None
        if stop.signum is not None:  # training was over: keep the model, skip the rest
            raise TrainingStopped(f"Stopped by signal {stop.signum} after training; the trained model is in "
                                  f"{model_path}.", 128 + stop.signum)
        if split.test is not None and cfg.eval.after and is_main:
            eval_after = score(split.test, "test_after", trainer.state.global_step)  # the weights in model/
            before = eval_before["scores"] if eval_before is not None else None
            if before is None and checkpoint is not None and ledger is not None:  # resumed: the first start's
                before = heldout_scores(ledger.path, "test_before", split.test["prompt"])
            if before is not None:  # the same prompts, in the same order: the gain and its standard error
                gain, se = paired_gain(before, eval_after["scores"])
                eval_after |= {"gain": round(gain, 4), "gain_se": None if se is None else round(se, 4)}
            log_eval(tracker, "eval_after", eval_after, step=trainer.state.global_step)
        for metrics in (eval_before, eval_after):  # per-prompt scores: not in summary.json (the ledger has them)
            if metrics is not None:
                metrics.pop("scores", None)
        if cfg.lora.enabled and cfg.lora.save_merged and model_path and is_main:
            merged = trainer.model.merge_and_unload()
            replace_dir_durably(run_dir / "model_merged", lambda tmp: (merged.save_pretrained(tmp),
                                                                       tokenizer.save_pretrained(tmp)))
        result = _result(trainer, split, run_dir, model_path, eval_before, eval_after, tracker, started,
                         train_seconds, validation, stop)
        result.startup_seconds = round(train_started - started, 1)
        if ledger is not None:
            result.ledger_seconds = round(ledger.seconds, 3)
            ledger.log_to_mlflow(tracker, cfg.ledger.mlflow_max_rows)
        if is_main:
            write_outputs(result, run_dir, tracker)
        tracker.end("FINISHED", unsent_path=run_dir / UNSENT_FILE)
        return result
    except BaseException as raised:
        e = raised
        if trainer is not None and _nan_sampling(raised):  # the weights are finite, what they compute is not
            e = Diverged(f"Training diverged after step {trainer.state.global_step}: the policy's next-token "
                         f"probabilities are not finite ({str(raised).splitlines()[0][:120]}). "
                         f"{guard.fix(trainer.state.global_step)}")
        if trainer is not None and trainer.state.global_step > 0 and not isinstance(e, TrainingStopped):
            _save_interrupted(trainer, run_dir)
        stopped = isinstance(e, KeyboardInterrupt | TrainingStopped) and stop.reason is None
        try:
            tracker.set_tag("error", (str(e) or e.__class__.__name__).splitlines()[0][:500])
        except TrackingError:
            pass
        tracker.end("KILLED" if stopped else "FAILED", unsent_path=run_dir / UNSENT_FILE)
        if e is not raised:
            raise e from raised
        raise
    finally:
        stop.uninstall()
        if rollout is not None:
            rollout.close()


def plan_only(cfg: DictConfig, launch_dir: str | None = None, env: Any = None):
    """The run plan this config would run with (`python -m grpo_pipeline ... --plan`): the env and its dataset
    are built, no weights load, nothing is written."""
    check_config(cfg)
    env, tokenizer, dataset, tool_functions = load_env_and_dataset(cfg, env, launch_dir, render_tools=False)
    return make_plan(cfg, env, tokenizer, _split(cfg, env, dataset), tool_functions, type(env).__qualname__)


def _split(cfg, env, dataset) -> Split:
    """Training, test and validation prompts (held out only with eval.enabled)."""
    if not cfg.eval.enabled:
        return Split(dataset, None, None)
    return split_heldout(dataset, cfg.eval, type(env).__qualname__, _as_list(getattr(env, "heldout_group_by", None)))


def load_env_and_dataset(cfg: DictConfig, env: Any = None, launch_dir: str | None = None,
                         render_tools: bool = True) -> tuple[Any, Any, Any, list]:
    """The env, the tokenizer (no weights), the checked dataset and the env's tool functions. With
    `render_tools`, chat prompts of an env with tool schemas are rendered to text with them."""
    env = load_env(OmegaConf.to_container(cfg.env, resolve=True), env, launch_dir)
    tokenizer = load_tokenizer(cfg.model)
    tool_functions = get_tool_functions(env, tokenizer)
    dataset = build_env_dataset(env, tokenizer)
    if render_tools and not tool_functions:  # with tool functions TRL renders the prompts with their schemas
        dataset = attach_tools(dataset, tokenizer, get_tool_schemas(env), type(env).__qualname__)
    return env, tokenizer, dataset, tool_functions


def _check_fits_vllm(cfg, rollout, dataset, env_name: str) -> None:
    """vLLM refuses a sequence longer than vllm.max_model_len mid-run: check the longest episode before the run."""
    i, prompt_tokens, tokens = rollout.longest_episode(dataset["prompt"])
    if tokens <= cfg.vllm.max_model_len:
        return
    budget = ("runtime.max_episode_tokens" if rollout.multi_turn else "generation.max_new_tokens")
    raise ConfigError(f"vllm.max_model_len={cfg.vllm.max_model_len} is too short for {env_name}: dataset row {i} has "
                      f"a {prompt_tokens}-token prompt, and with {budget}={rollout.max_episode_tokens} its episode "
                      f"can reach {tokens} tokens, which vLLM would refuse in the middle of the run. Set "
                      f"vllm.max_model_len={tokens} or more, or lower {budget}.")


def sampling(gen) -> dict:
    """How training samples: the runtime's turns, and the model calls of an env's own score_episode."""
    return {"do_sample": True, "temperature": gen.temperature, "top_k": gen.top_k, "top_p": gen.top_p}


def _open_run(cfg, plan, tracker, run_dir, checkpoint, env_name, overrides, tags, is_main, run_uid,
              launch_dir) -> None:
    """Reopen the run's MLflow run (a resume), or start one and write the run's record, its config as given
    (never rewritten: a resume's changes go to config_changes.yaml) and its plan (plan.json; a resume's own plan
    goes to plan-step<N>.json)."""
    if checkpoint is not None and is_main:
        remove_incomplete(run_dir)
    if checkpoint is not None:
        if (run_dir / RUN_ID_FILE).exists():
            tracker.resume((run_dir / RUN_ID_FILE).read_text().strip(), checkpoint)
        log.warning("Resuming %s from %s", run_dir, checkpoint.name)
        if is_main:  # (logged to MLflow with the other outputs at the end: a store that is down never holds the start)
            if (run_dir / PLAN_FILE).exists():
                path = run_dir / f"plan-step{_step_of(checkpoint)}.json"
                path.write_text(json.dumps(plan.as_dict(), indent=2, default=str))
            else:
                plan.write(run_dir)
        return
    all_tags = {"env": env_name, "model": cfg.model.name,
                "overrides": " ".join(mask_override(o) for o in overrides or [])}
    params = flatten(masked_config(cfg)) | {f"plan.{c.key}": str(c.value)[:500] for c in plan.choices}
    tracker.start(cfg.tracking.run_name or run_name(cfg, env_name, overrides), params, all_tags | (tags or {}),
                  description=description(cfg, env_name, overrides))
    if is_main:
        if tracker.run_id:
            (run_dir / RUN_ID_FILE).write_text(tracker.run_id)
        (run_dir / "resolved_config.yaml").write_text(OmegaConf.to_yaml(masked_config(cfg)))
        write_record(run_dir, overrides or [], launch_dir, tracker.uri if tracker.enabled else None, tracker.run_id,
                     uid=run_uid)
        plan.write(run_dir)


def _build_trainer(cfg, tokenizer, dataset, reward_funcs, grpo_config, tracker, lora_targets, tools, rollout,
                   extra_columns, ledger):
    from transformers.trainer_callback import PrinterCallback

    from grpo_pipeline.training.trainer import PipelineTrainer, rollout_func

    model = load_model(cfg.model, tokenizer)
    peft_config = None
    if cfg.lora.enabled:
        from peft import LoraConfig

        peft_config = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                                 target_modules=lora_targets, task_type="CAUSAL_LM")
    dynamic = cfg.generation.oversample > 1 or cfg.generation.resample_flat
    trainer = PipelineTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=grpo_config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[RunLogger(tracker)],
        tools=tools or None,
        rollout_func=rollout_func(rollout, sampling(cfg.generation), extra_columns) if rollout else None,
        shared_prefix_loss=cfg.training.shared_prefix_loss,
        train_completions=cfg.training.batch_size if dynamic else None,
        resample_flat=cfg.generation.resample_flat if dynamic else 0,
        flat_negative=cfg.generation.flat_negative if dynamic else 0.0,
        rollout=rollout,
        ledger=ledger,
        record_episodes=bool(cfg.ledger.enabled),
    )
    trainer.remove_callback(PrinterCallback)  # RunLogger prints one readable line per step instead
    return trainer


def _add_validation(cfg, trainer, stop, score, split, run_dir, policy, tracker, checkpoint, is_main):
    """The validation callback (main process only), restored from the checkpoint on resume."""
    if split.val is None or cfg.eval.every_steps <= 0 or not is_main:
        return None
    from grpo_pipeline.evaluation.best_model import Validation

    best_dir = run_dir / "best" if cfg.eval.keep_best else None
    validation = Validation(lambda: score(split.val, "val", trainer.state.global_step), cfg.eval.every_steps,
                            cfg.eval.early_stop_patience, best_dir, policy, tracker, cfg.eval.best_margin)
    if checkpoint is not None:
        stored = json.loads((checkpoint / "trainer_state.json").read_text()).get("stateful_callbacks", {})
        validation.restore(stored.get("Validation"))
    trainer.add_callback(validation)
    stop.validation = validation
    return validation


def _open_ledger(cfg, run_dir: Path, tokenizer, checkpoint: Path | None):
    """The episode ledger; a resumed run first drops the lines of steps after its checkpoint."""
    if not cfg.ledger.enabled:
        return None
    from grpo_pipeline.tracking.ledger import Ledger

    ledger = Ledger(run_dir, tokenizer, cfg.ledger.max_per_step, cfg.ledger.max_chars, cfg.seed)
    if checkpoint is not None:
        step = json.loads((checkpoint / "trainer_state.json").read_text())["global_step"]
        dropped = ledger.truncate_after(step)
        if dropped:
            log.warning("episode ledger: dropped %d episode(s) of steps after %d (they run again)", dropped, step)
    return ledger


def _save_models(cfg, trainer, tokenizer, run_dir: Path, validation) -> str:
    """model/ (the best validation step's weights when validation keeps them and the best clearly beat the last,
    else the last: Validation.model_step) and model-last/."""
    if validation is not None and validation.best_dir is not None:
        _save_model_dir(trainer, tokenizer, run_dir / "model-last")
        step, why = validation.model_step()
        validation.kept_step = validation.last_step
        if step != validation.last_step:
            if validation.restore_best():
                validation.kept_step = step
            else:  # restore_best logged why
                why = "the last step's, since the best step's weights could not be loaded"
        if validation.kept_step is not None:
            log.warning("model/: the weights of step %d: %s", validation.kept_step, why)
        validation.prune()
    path = run_dir / "model"
    _save_model_dir(trainer, tokenizer, path)  # the LoRA adapter when lora.enabled, else the full weights
    return str(path)


def _save_model_dir(trainer, tokenizer, path: Path) -> None:
    """Written under a temporary name, fsync'd and renamed (checkpoints.replace_dir_durably): a crash leaves the
    old folder or the new one whole. Every process takes part in save_model; the main one renames."""
    main = trainer.is_world_process_zero()

    def write(tmp: Path) -> None:
        trainer.save_model(str(tmp))
        trainer.accelerator.wait_for_everyone()
        if main:
            tokenizer.save_pretrained(tmp)

    if main:
        replace_dir_durably(path, write)
    else:
        write(path.with_name(f".{path.name}.partial"))


def _save_interrupted(trainer, run_dir: Path) -> None:
    path = run_dir / "model-interrupted"
    if not finite([p for p in trainer.model.parameters() if p.requires_grad]):
        log.error("Training stopped at step %d with non-finite weights: model-interrupted/ is not written.",
                  trainer.state.global_step)
        return
    try:
        trainer.save_model(str(path))
        log.error("Training stopped at step %d; what was trained so far is in %s", trainer.state.global_step, path)
    except Exception:  # saving must not hide the original error
        log.exception("Could not save the interrupted model to %s", path)


def _result(trainer, split, run_dir, model_path, eval_before, eval_after, tracker, started, train_seconds,
            validation, stop) -> RunResult:
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    v = validation
    return RunResult(
        run_dir=str(run_dir), model_path=model_path, num_samples=len(split.train),
        num_epochs=float(trainer.state.epoch or 0.0), steps=trainer.state.global_step,
        first_reward=rewards[0] if rewards else None, last_reward=rewards[-1] if rewards else None,
        average_reward=sum(rewards) / len(rewards) if rewards else None,
        eval_before=eval_before, eval_after=eval_after, mlflow_run_id=tracker.run_id,
        wall_time_s=round(time.monotonic() - started, 1), train_seconds=round(train_seconds, 2), rewards=rewards,
        best_step=v.best_step if v else None, best_val=v.best_score if v else None,
        model_step=(v.last_step if v.kept_step is None else v.kept_step) if v else None,
        last_step=v.last_step if v else None, last_val=v.last_score if v else None,
        validation=[list(x) for x in v.history] if v else None, stopped_early=stop.stopped_early,
        eval_seconds=round(v.seconds, 2) if v else 0.0,
    )


def _nan_sampling(error: BaseException) -> bool:
    """torch.multinomial's (HF generate) and the runtime sampler's error on a NaN/inf distribution."""
    return isinstance(error, RuntimeError) and "probability tensor contains either" in str(error)


def _step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.rsplit("-", 1)[1])


def _as_list(value) -> list[str]:
    return [] if value is None else [value] if isinstance(value, str) else list(value)
