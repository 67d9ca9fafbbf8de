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
from dataclasses import dataclass, field
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
from grpo_pipeline.envs.loader import (
    env_name as name_of,
)
from grpo_pipeline.envs.runner import EpisodeRunner
from grpo_pipeline.errors import ConfigError
from grpo_pipeline.evaluation.heldout import Split, evaluate, paired_gain, split_heldout
from grpo_pipeline.models import load_model, load_tokenizer, lora_target_modules, model_dir
from grpo_pipeline.prompts import attach_tools, place_tools
from grpo_pipeline.rewards.assemble import build_rewards
from grpo_pipeline.rollout.sentinel import LogpGapWatch, WeightsSentinel
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
from grpo_pipeline.training.callbacks import (
    Diverged,
    DivergenceGuard,
    NoSignalGuard,
    RunLogger,
    StopControl,
    finite,
)
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
    run = prepare(cfg, launch_dir, overrides, env, tags)  # no weights, no MLflow run: a bad config fails in seconds
    with Bookkeeping(run) as book:  # FAILED/KILLED, model-interrupted/, unsent metrics, signals
        _open_run(run)
        ledger = _open_ledger(run)
        trainer = book.trainer = _build_trainer(run, ledger, [CheckpointMarker(run.uid, run.cfg.training.save_total_limit),
                                                             book.guard, *filter(None, [book.no_signal])])
        score, validation = _evaluation(run, trainer, ledger, book.stop)
        eval_before = _eval_before(run, score)
        train_seconds = _fit(run, trainer, book.stop, validation)
        model_path = _save_models(run, trainer, validation) if run.cfg.training.save_model else None
        if book.stop.signum is not None:  # training was over: keep the model, skip the rest
            raise TrainingStopped(f"Stopped by signal {book.stop.signum} after training; the trained model is in "
                                  f"{model_path}.", 128 + book.stop.signum)
        eval_after = _eval_after(run, score, trainer, eval_before, ledger)
        _save_merged(run, trainer, model_path)
        result = _result(run, trainer, model_path, eval_before, eval_after, train_seconds, validation, book.stop)
        return book.finished(result, ledger)


@dataclass
class Run:
    """What `prepare` decided before any weights load: every later stage takes this, not ten parameters."""

    cfg: DictConfig  # the run's config: the plan applied (the step fitted to the data)
    given: DictConfig  # the config as given: resolved_config.yaml and the MLflow params
    plan: Any
    env: Any
    env_name: str
    tokenizer: Any
    split: Split
    runner: EpisodeRunner
    rollout: Any  # None: TRL generates
    tool_functions: list
    extra_columns: list[str]
    reward_funcs: list
    grpo_config: Any
    lora_targets: Any
    tracker: Tracker
    run_dir: Path
    record: dict | None  # run.json of the run dir (a resume), else None
    checkpoint: Path | None  # the checkpoint a resume continues from
    changes: dict  # config keys a resume changed (resume_allow)
    uid: str
    is_main: bool
    launch_dir: str
    overrides: list[str]
    tags: dict[str, str]
    started: float = field(default_factory=time.monotonic)
    startup_seconds: float = 0.0  # from the start to the first training step


def prepare(cfg: DictConfig, launch_dir: str | None = None, overrides: list[str] | None = None,
            env: Any = None, tags: dict[str, str] | None = None) -> Run:
    """Everything that can be checked and decided without weights: the config, the run dir's claim, the env and
    its dataset, the plan, the rollout, the rewards and TRL's arguments."""
    started = time.monotonic()
    redact_log_records()
    register_config(cfg)  # secret values are masked in everything the run writes; the env gets the real ones
    launch_dir = launch_dir or os.getcwd()
    is_main = int(os.environ.get("RANK", "0")) == 0
    check_config(cfg)
    run_dir = Path(cfg.output_dir if cfg.resume in (None, "auto") else cfg.resume)
    record, checkpoints = claim(run_dir, cfg.resume, main=is_main)  # one run per run dir; only its own checkpoints
    changes = check_changes(run_dir, masked_config(cfg), list(cfg.resume_allow)) if record else {}
    checkpoint = first_loadable(checkpoints)  # the newest that loads; a resume with none that loads is an error
    if checkpoints and checkpoint is None:
        raise ConfigError(f"resume={cfg.resume}: none of the run's checkpoints "
                          f"({', '.join(p.name for p in checkpoints)}) loads (see the warnings above).")
    env, tokenizer, dataset, tool_functions = load_env_and_dataset(cfg, env, launch_dir, render_tools=False)
    env_name = name_of(env)
    split = _split(cfg, env, dataset)
    plan = make_plan(cfg, env, tokenizer, split, tool_functions, env_name)  # every choice, once (config/plan.py)
    if is_main:
        log.warning("%s", plan.table())
    given, cfg = cfg, plan.applied(cfg)  # the run's config: the step fitted to the data; the one given is kept
    extra_columns = [c for c in dataset.column_names if c != "prompt"]
    runner = EpisodeRunner(env, tokenizer, cfg.runtime, extra_columns, sampling=sampling(cfg.generation),
                           seed=f"{cfg.seed}|{os.environ.get('RANK', '0')}")  # each process its own episode seeds
    rollout = make_rollout(plan, env, tokenizer, runner, lambda: model_dir(cfg.model))  # None: TRL generates
    if rollout is not None and rollout.multi_turn:
        rollout.check_template(dataset[0]["prompt"], cfg.model.name)  # at startup, not at the first env turn
    if rollout is not None and rollout.uses_vllm:
        _check_fits_vllm(cfg, rollout, dataset, env_name)
    if rollout is None and not tool_functions:  # TRL renders chat prompts without tools: give it text
        split = Split(*(attach_tools(d, tokenizer, get_tool_schemas(env), env_name) if d is not None else None
                        for d in (split.train, split.test, split.val)))
    lora_targets = lora_target_modules(cfg.lora.target_modules) if cfg.lora.enabled else None
    with importable_from(launch_dir):  # reward components may live in the launch dir, like the env
        reward_funcs, reward_weights = build_rewards(cfg.reward, runner.reward_function(), dataset.column_names)
    from grpo_pipeline.config.grpo_args import build_grpo_config  # imports TRL: after the cheap checks

    grpo_config = build_grpo_config(cfg, str(run_dir / "checkpoints"), reward_weights, bool(tool_functions),
                                    use_vllm=not plan.runtime_generates and cfg.vllm.mode != "off")
    tracker = Tracker(cfg.tracking, launch_dir, enabled=is_main,
                      uri=(record or {}).get("tracking_uri"))  # a resume writes to the store the run started in
    return Run(cfg=cfg, given=given, plan=plan, env=env, env_name=env_name, tokenizer=tokenizer, split=split,
               runner=runner, rollout=rollout, tool_functions=tool_functions, extra_columns=extra_columns,
               reward_funcs=reward_funcs, grpo_config=grpo_config, lora_targets=lora_targets, tracker=tracker,
               run_dir=run_dir, record=record, checkpoint=checkpoint, changes=changes,
               uid=record["uid"] if record else uuid.uuid4().hex[:12], is_main=is_main, launch_dir=launch_dir,
               overrides=list(overrides or []), tags=dict(tags or {}), started=started)


class Bookkeeping:
    """The run's bookkeeping around training, in one place. Inside it SIGINT/SIGTERM end the run cleanly
    (after the current step). On the way out:
    - a normal end (`finished`): the outputs written, the MLflow run FINISHED;
    - a signal or a stop (TrainingStopped, KeyboardInterrupt): the MLflow run KILLED;
    - any other error: what was trained is saved to `<run dir>/model-interrupted` (if finite), the run FAILED;
    - always: metrics a store that stayed down never got go to `<run dir>/metrics_unsent.jsonl`, the signal
      handlers are restored and the rollout (vLLM engine, policy copy) is closed."""

    def __init__(self, run: Run):
        self.run, self.trainer = run, None
        self.stop = StopControl(run.tracker, max_minutes=run.cfg.training.max_minutes)
        quiet, args = run.cfg.training.no_signal, run.grpo_config
        self.no_signal = NoSignalGuard(self.stop, quiet.flat_share, quiet.patience, quiet.min_groups, quiet.min_entropy,
                                       args.generation_batch_size // args.num_generations) if quiet.enabled else None
        self.guard = DivergenceGuard(run.cfg.training.learning_rate)

    def __enter__(self) -> "Bookkeeping":
        self.run.run_dir.mkdir(parents=True, exist_ok=True)
        self.stop.install()
        return self

    def finished(self, result: RunResult, ledger) -> RunResult:
        run = self.run
        if ledger is not None:
            result.ledger_seconds = round(ledger.seconds, 3)
            ledger.log_to_mlflow(run.tracker, run.cfg.ledger.mlflow_max_rows)
        if run.is_main:
            write_outputs(result, run.run_dir, run.tracker)
        run.tracker.end("FINISHED", unsent_path=run.run_dir / UNSENT_FILE)
        return result

    def __exit__(self, kind, raised, traceback) -> bool:
        try:
            if raised is not None:
                self._failed(raised)
        finally:
            self.stop.uninstall()
            if self.run.rollout is not None:
                self.run.rollout.close()
        return False

    def _failed(self, raised: BaseException) -> None:
        trainer, tracker = self.trainer, self.run.tracker
        e = raised
        if trainer is not None and _nan_sampling(raised):  # the weights are finite, what they compute is not
            e = Diverged(f"Training diverged after step {trainer.state.global_step}: the policy's next-token "
                         f"probabilities are not finite ({str(raised).splitlines()[0][:120]}). "
                         f"{self.guard.fix(trainer.state.global_step)}")
        if trainer is not None and trainer.state.global_step > 0 and not isinstance(e, TrainingStopped):
            _save_interrupted(trainer, self.run.run_dir)
        stopped = isinstance(e, KeyboardInterrupt | TrainingStopped) and self.stop.reason is None
        try:
            tracker.set_tag("error", (str(e) or e.__class__.__name__).splitlines()[0][:500])
        except TrackingError:
            pass
        tracker.end("KILLED" if stopped else "FAILED", unsent_path=self.run.run_dir / UNSENT_FILE)
        if e is not raised:
            raise e from raised


def _evaluation(run: Run, trainer, ledger, stop):
    """The held-out scorer (`score(dataset, split_name, step)`) and the validation callback (None without one)."""
    policy = trainer.accelerator.unwrap_model(trainer.model)
    run.runner.bind(policy)
    cfg = run.cfg
    eval_tokens = cfg.eval.max_new_tokens or cfg.generation.max_new_tokens
    total = None
    if cfg.eval.reward == "total":  # held-out sets scored by the reward training sums, not the env's score alone
        from grpo_pipeline.rewards.total import TotalReward

        env_first = 1 if cfg.reward.env_weight > 0 else 0  # build_rewards puts the env's reward first
        total = TotalReward(cfg.reward.env_weight, list(zip(run.reward_funcs, run.grpo_config.reward_weights,
                                                            strict=True))[env_first:], run.tokenizer, trainer.state)
    kl = None
    if run.split.val is not None and cfg.eval.every_steps > 0 and run.is_main:  # eval_val/kl_to_base, any kl_coef
        from grpo_pipeline.evaluation.kl_to_base import KlToBase

        kl = KlToBase.for_trainer(trainer, cfg.eval.batch_size)

    def score(dataset, split_name: str, step: int) -> dict:
        result = evaluate(policy, run.tokenizer, run.runner, dataset, eval_tokens, cfg.eval.batch_size, run.rollout,
                          cap_turn_tokens=cfg.eval.max_new_tokens, total=total, kl=kl if split_name == "val" else None)
        episodes = result.pop("episodes", None)
        if ledger is not None and episodes is not None:
            ledger.record(split_name, step, episodes["prompts"], episodes["completions"], episodes["rewards"],
                          totals=episodes["totals"], rows=episodes["rows"], seconds=episodes["seconds"],
                          failures=episodes["failures"], transcripts=bool(run.rollout and run.rollout.multi_turn))
        return result

    validation = _add_validation(run, trainer, stop, score, policy)
    trainer.add_callback(stop)  # after validation: an early stop is decided in the same step
    return score, validation


def _eval_before(run: Run, score) -> dict | None:
    """The test set before training (a resumed run never repeats it)."""
    if run.split.test is None or not run.cfg.eval.before or run.checkpoint is not None or not run.is_main:
        return None
    result = score(run.split.test, "test_before", 0)
    log_eval(run.tracker, "eval_before", result, step=0, now=True)
    return result


def _fit(run: Run, trainer, stop, validation) -> float:
    """trainer.train. A stop before the end (a signal, training.max_minutes; validation's patience is a normal
    end) raises TrainingStopped with the command that continues. Returns the training seconds."""
    if stop.signum is not None:
        raise TrainingStopped(f"Stopped by signal {stop.signum} before training started; nothing was trained.",
                              128 + stop.signum)
    train_started = time.monotonic()
    run.startup_seconds = round(train_started - run.started, 1)
    trainer.train(resume_from_checkpoint=str(run.checkpoint) if run.checkpoint else None)
    train_seconds = time.monotonic() - train_started
    completed = trainer.state.global_step >= trainer.state.max_steps or stop.stopped_early
    if stop.reason is not None or (stop.signum is not None and not completed):
        why = f"by signal {stop.signum}" if stop.signum is not None else f"because {stop.reason}"
        raise TrainingStopped(
            f"Stopped {why} at step {trainer.state.global_step}; a checkpoint was saved in "
            f"{run.run_dir / 'checkpoints'}. Continue with:\n  {resume_command(run.run_dir)}",
            128 + stop.signum if stop.signum is not None else 3)
    if validation is not None and validation.last_step != trainer.state.global_step:
        validation.validate(trainer.state)  # stopped between validations (max_minutes): score the live weights
    return train_seconds


def _eval_after(run: Run, score, trainer, eval_before: dict | None, ledger) -> dict | None:
    """The test set after training (the weights in model/), with the paired gain over the same prompts before.
    Per-prompt scores leave both results here: the ledger has them, summary.json does not."""
    eval_after = None
    if run.split.test is not None and run.cfg.eval.after and run.is_main:
        eval_after = score(run.split.test, "test_after", trainer.state.global_step)
        before = eval_before["scores"] if eval_before is not None else None
        if before is None and run.checkpoint is not None and ledger is not None:  # resumed: the first start's
            before = heldout_scores(ledger.path, "test_before", run.split.test["prompt"])
        if before is not None:  # the same prompts, in the same order: the gain and its standard error
            gain, se = paired_gain(before, eval_after["scores"])
            eval_after |= {"gain": round(gain, 4), "gain_se": None if se is None else round(se, 4)}
        log_eval(run.tracker, "eval_after", eval_after, step=trainer.state.global_step)
    for metrics in (eval_before, eval_after):
        if metrics is not None:
            metrics.pop("scores", None)
    return eval_after


def _save_merged(run: Run, trainer, model_path: str | None) -> None:
    """model_merged/: the LoRA adapter merged into the base weights (lora.save_merged)."""
    if run.cfg.lora.enabled and run.cfg.lora.save_merged and model_path and run.is_main:
        merged = trainer.model.merge_and_unload()
        replace_dir_durably(run.run_dir / "model_merged", lambda tmp: (merged.save_pretrained(tmp),
                                                                       run.tokenizer.save_pretrained(tmp)))


def plan_only(cfg: DictConfig, launch_dir: str | None = None, env: Any = None):
    """The run plan this config would run with (`python -m grpo_pipeline ... --plan`): the env and its dataset
    are built, no weights load, nothing is written."""
    check_config(cfg)
    env, tokenizer, dataset, tool_functions = load_env_and_dataset(cfg, env, launch_dir, render_tools=False)
    return make_plan(cfg, env, tokenizer, _split(cfg, env, dataset), tool_functions, name_of(env))


def _split(cfg, env, dataset) -> Split:
    """Training, test and validation prompts (held out only with eval.enabled)."""
    if not cfg.eval.enabled:
        return Split(dataset, None, None)
    return split_heldout(dataset, cfg.eval, name_of(env), _as_list(getattr(env, "heldout_group_by", None)),
                         by_prompt=getattr(env, "prompt_is_task", True))


def load_env_and_dataset(cfg: DictConfig, env: Any = None, launch_dir: str | None = None,
                         render_tools: bool = True) -> tuple[Any, Any, Any, list]:
    """The env, the tokenizer (no weights), the checked dataset and the env's tool functions. With
    `render_tools`, chat prompts of an env with tool schemas are rendered to text with them."""
    env = load_env(OmegaConf.to_container(cfg.env, resolve=True), env, launch_dir)
    tokenizer = load_tokenizer(cfg.model)
    tool_functions = get_tool_functions(env, tokenizer)
    dataset = build_env_dataset(env, tokenizer)
    if not tool_functions:  # the schemas of get_tools(): the template's, or a preamble in every prompt (prompts.py)
        dataset = place_tools(dataset, tokenizer, get_tool_schemas(env), name_of(env),
                              described=bool(getattr(env, "describes_tools", False)))
    if render_tools and not tool_functions:  # with tool functions TRL renders the prompts with their schemas
        dataset = attach_tools(dataset, tokenizer, get_tool_schemas(env), name_of(env))
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


def _open_run(run: Run) -> None:
    """Reopen the run's MLflow run (a resume), or start one and write the run's record, its config as given
    (never rewritten: a resume's changes go to config_changes.yaml) and its plan (plan.json; a resume's own plan
    goes to plan-step<N>.json)."""
    run_dir, tracker, checkpoint, plan = run.run_dir, run.tracker, run.checkpoint, run.plan
    if checkpoint is not None:
        if run.is_main:
            remove_incomplete(run_dir)
        if (run_dir / RUN_ID_FILE).exists():
            tracker.resume((run_dir / RUN_ID_FILE).read_text().strip(), checkpoint)
        log.warning("Resuming %s from %s", run_dir, checkpoint.name)
        if run.is_main:  # (logged to MLflow with the other outputs at the end: a store that is down never holds the start)
            if (run_dir / PLAN_FILE).exists():
                path = run_dir / f"plan-step{_step_of(checkpoint)}.json"
                path.write_text(json.dumps(plan.as_dict(), indent=2, default=str))
            else:
                plan.write(run_dir)
            record_changes(run_dir, _step_of(checkpoint), run.changes, tracker)
        return
    cfg, overrides = run.given, run.overrides
    all_tags = {"env": run.env_name, "model": cfg.model.name, "overrides": " ".join(mask_override(o) for o in overrides)}
    params = flatten(masked_config(cfg)) | {f"plan.{c.key}": str(c.value)[:500] for c in plan.choices}
    tracker.start(cfg.tracking.run_name or run_name(cfg, run.env_name, overrides), params, all_tags | run.tags,
                  description=description(run.cfg, run.env_name, overrides))  # what is trained: the plan applied
    if run.is_main:
        if tracker.run_id:
            (run_dir / RUN_ID_FILE).write_text(tracker.run_id)
        (run_dir / "resolved_config.yaml").write_text(OmegaConf.to_yaml(masked_config(cfg)))
        write_record(run_dir, overrides, run.launch_dir, tracker.uri if tracker.enabled else None, tracker.run_id,
                     uid=run.uid)
        plan.write(run_dir)


def _build_trainer(run: Run, ledger, callbacks: list):
    """The model (weights load here), the LoRA config and PipelineTrainer (training/trainer.py)."""
    from transformers.trainer_callback import PrinterCallback

    from grpo_pipeline.training.trainer import PipelineTrainer, rollout_func

    cfg, rollout = run.cfg, run.rollout
    model = load_model(cfg.model, run.tokenizer)
    peft_config = None
    if cfg.lora.enabled:
        from peft import LoraConfig

        peft_config = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                                 target_modules=run.lora_targets, task_type="CAUSAL_LM")
    dynamic = cfg.generation.oversample > 1 or cfg.generation.resample_flat
    trainer = PipelineTrainer(
        model=model,
        reward_funcs=run.reward_funcs,
        args=run.grpo_config,
        train_dataset=run.split.train,
        processing_class=run.tokenizer,
        peft_config=peft_config,
        callbacks=[RunLogger(run.tracker)],
        tools=run.tool_functions or None,
        rollout_func=rollout_func(rollout, sampling(cfg.generation), run.extra_columns) if rollout else None,
        shared_prefix_loss=cfg.training.shared_prefix_loss,
        train_completions=cfg.training.batch_size if dynamic else None,
        resample_flat=cfg.generation.resample_flat if dynamic else 0,
        flat_negative=cfg.generation.flat_negative if dynamic else 0.0,
        rollout=rollout,
        ledger=ledger,
        record_episodes=bool(cfg.ledger.enabled),
        runner=run.runner,
        turn_credit=run.plan.turn_credit == "turn",
        logp_watch=(LogpGapWatch(cfg.sentinel.logp_gap_warn, cfg.sentinel.logp_gap_stop, cfg.sentinel.patience)
                    if cfg.sentinel.enabled else None),
    )
    if rollout is not None and cfg.sentinel.enabled:  # the copy that samples is probed against the policy
        dtype = run.plan.generation_dtype or cfg.model.dtype
        rollout.sentinel = WeightsSentinel(f"the runtime's merged {dtype} copy of the policy (runtime.merged_generation"
                                           f"{', runtime.generation_dtype' if run.plan.generation_dtype else ''})",
                                           every_steps=cfg.sentinel.every_steps)
    trainer.remove_callback(PrinterCallback)  # RunLogger prints one readable line per step instead
    if cfg.tracking.report_to:  # transformers' TensorBoard / wandb callbacks (report_to) write into the run dir
        from grpo_pipeline.tracking.integrations import point_at_run_dir

        point_at_run_dir(trainer, run.run_dir, cfg.tracking.experiment_name)
    for callback in callbacks:
        trainer.add_callback(callback)
    return trainer


def _add_validation(run: Run, trainer, stop, score, policy):
    """The validation callback (main process only), restored from the checkpoint on resume."""
    cfg, split = run.cfg, run.split
    if split.val is None or cfg.eval.every_steps <= 0 or not run.is_main:
        return None
    from grpo_pipeline.evaluation.best_model import Validation

    best_dir = run.run_dir / "best" if cfg.eval.keep_best else None
    validation = Validation(lambda: score(split.val, "val", trainer.state.global_step), cfg.eval.every_steps,
                            cfg.eval.early_stop_patience, best_dir, policy, run.tracker, cfg.eval.best_margin)
    if run.checkpoint is not None:
        stored = json.loads((run.checkpoint / "trainer_state.json").read_text()).get("stateful_callbacks", {})
        validation.restore(stored.get("Validation"))
    trainer.add_callback(validation)
    stop.validation = validation
    return validation


def _open_ledger(run: Run):
    """The episode ledger (main process only); a resumed run first drops the lines of steps after its checkpoint."""
    if not run.cfg.ledger.enabled or not run.is_main:
        return None
    from grpo_pipeline.tracking.ledger import Ledger

    cfg = run.cfg
    ledger = Ledger(run.run_dir, run.tokenizer, cfg.ledger.max_per_step, cfg.ledger.max_chars, cfg.seed)
    if run.checkpoint is not None:
        step = json.loads((run.checkpoint / "trainer_state.json").read_text())["global_step"]
        dropped = ledger.truncate_after(step)
        if dropped:
            log.warning("episode ledger: dropped %d episode(s) of steps after %d (they run again)", dropped, step)
    return ledger


def _save_models(run: Run, trainer, validation) -> str:
    """model/ (the best validation step's weights when validation keeps them and the best clearly beat the last,
    else the last: Validation.model_step) and model-last/."""
    if validation is not None and validation.best_dir is not None:
        _save_model_dir(trainer, run.tokenizer, run.run_dir / "model-last")
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
    path = run.run_dir / "model"
    _save_model_dir(trainer, run.tokenizer, path)  # the LoRA adapter when lora.enabled, else the full weights
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


def _result(run: Run, trainer, model_path, eval_before, eval_after, train_seconds, validation, stop) -> RunResult:
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    scored = [r for r in rewards if r is not None and r == r]  # a step whose episodes all failed has none (TRL: NaN)
    v = validation
    return RunResult(
        run_dir=str(run.run_dir), model_path=model_path, num_samples=len(run.split.train),
        num_epochs=float(trainer.state.epoch or 0.0), steps=trainer.state.global_step,
        first_reward=scored[0] if scored else None, last_reward=scored[-1] if scored else None,
        average_reward=sum(scored) / len(scored) if scored else None,
        eval_before=eval_before, eval_after=eval_after, mlflow_run_id=run.tracker.run_id,
        wall_time_s=round(time.monotonic() - run.started, 1), train_seconds=round(train_seconds, 2), rewards=rewards,
        best_step=v.best_step if v else None, best_val=v.best_score if v else None,
        model_step=(v.last_step if v.kept_step is None else v.kept_step) if v else None,
        last_step=v.last_step if v else None, last_val=v.last_score if v else None,
        validation=[list(x) for x in v.history] if v else None, stopped_early=stop.stopped_early,
        eval_seconds=round(v.seconds, 2) if v else 0.0, startup_seconds=run.startup_seconds,
        eval_reward=str(run.cfg.eval.reward) if eval_before or eval_after or v else None,
        mlflow_ui=run.tracker.ui_links(),
    )


def _nan_sampling(error: BaseException) -> bool:
    """torch.multinomial's (HF generate) and the runtime sampler's error on a NaN/inf distribution."""
    return isinstance(error, RuntimeError) and "probability tensor contains either" in str(error)


def _step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.rsplit("-", 1)[1])


def _as_list(value) -> list[str]:
    return [] if value is None else [value] if isinstance(value, str) else list(value)
