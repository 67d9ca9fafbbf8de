"""The Trainer callbacks: the console line + MLflow metrics, and stopping cleanly.

`RunLogger` keeps the progress bar, prints one readable line per logging step and hands the metrics to
the Tracker; when a checkpoint is written it releases the metrics the checkpoint covers.
`StopControl` ends training at a step boundary with a checkpoint when SIGINT/SIGTERM arrives or the
tracking store has been down past its grace period. Under several processes the decision is all-reduced
every step, so a signal to any rank stops every rank after the same step (no rank left waiting in a
collective for the others).
"""

import logging
import math
import signal
import threading
import time

import torch
from transformers.trainer_callback import ProgressCallback, TrainerCallback

from grpo_pipeline.errors import PipelineError
from grpo_pipeline.tracking.mlflow_run import Tracker, numeric

log = logging.getLogger(__name__)


class RunLogger(ProgressCallback):
    ESTIMATE_AFTER = 3  # steps: then the run's length is estimated once, so nobody waits blind

    def __init__(self, tracker: Tracker):
        super().__init__()
        self.tracker = tracker
        self.step_seconds: list[float] = []
        self._step_started: float | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.tracker.hold_uncheckpointed(args.save_strategy != "no")
        return super().on_train_begin(args, state, control, **kwargs)

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_started = time.monotonic()
        return super().on_step_begin(args, state, control, **kwargs)

    def on_step_end(self, args, state, control, **kwargs):
        if self._step_started is not None:  # before validation (a later callback): a training step alone
            self.step_seconds.append(time.monotonic() - self._step_started)
            if len(self.step_seconds) == self.ESTIMATE_AFTER and state.is_world_process_zero:
                log.warning("%s", estimate(self.step_seconds, state.global_step, state.max_steps))
        return super().on_step_end(args, state, control, **kwargs)

    def on_save(self, args, state, control, **kwargs):
        self.tracker.checkpointed(state.global_step)  # trainer_state.json, the last file, is on disk

    def on_log(self, args, state, control, logs=None, **kwargs):
        metrics = numeric(logs or {})
        self.tracker.log_metrics(metrics, step=state.global_step)
        if "reward" not in metrics or not state.is_world_process_zero:
            return
        parts = [
            f"epoch {metrics.get('epoch', 0):.2f}/{state.num_train_epochs:g}",
            f"step {state.global_step}/{state.max_steps}",
            f"reward {metrics['reward']:.3f}",
        ]
        parts += [f"{key} {metrics[key]:.4g}" for key in ("kl", "loss") if key in metrics]
        if "entropy" in metrics:  # a policy collapsing onto one answer shows here first
            parts.append(f"entropy {metrics['entropy']:.3f}")
        if "frac_reward_zero_std" in metrics:  # groups that gave GRPO nothing
            parts.append(f"flat {metrics['frac_reward_zero_std']:.2f}")
        if "completions/mean_length" in metrics:
            parts.append(f"len {metrics['completions/mean_length']:.1f}")
        if metrics.get("env/failures"):
            parts.append(f"env failures {metrics['env/failures']:.0f}")
        (self.training_bar.write if self.training_bar is not None else print)(" | ".join(parts))


def estimate(step_seconds: list[float], step: int, max_steps: int) -> str:
    """How long the rest of the run takes at the median step time so far (held-out evaluation comes on top)."""
    median = sorted(step_seconds)[len(step_seconds) // 2]
    left = max(0, max_steps - step)
    ends = time.strftime("%H:%M", time.localtime(time.time() + left * median))
    return (f"Run length: {len(step_seconds)} steps took a median {median:.1f} s each; the remaining {left} step(s) "
            f"take ~{left * median / 60:.0f} min more (until ~{ends}), plus validation and the final test evaluation.")


EARLY_STOP, TRACKING_FAILED = 1, 100  # stop codes besides signal numbers; the highest wins across ranks


class StopControl(TrainerCallback):
    """Finish the current step, save a checkpoint, stop: on SIGINT/SIGTERM or when tracking gave up (an
    error stop), or when validation asks for an early stop or training.max_minutes is up (a normal end).
    `NoSignalGuard` stops through it too (an error stop, decided from the step's logs on every rank alike)."""

    def __init__(self, tracker: Tracker | None = None, validation=None, max_minutes: float | None = None):
        self.tracker, self.validation = tracker, validation
        self.max_minutes = max_minutes
        self.deadline: float | None = None
        self.signum: int | None = None
        self.reason: str | None = None  # why training stopped with an error, if it did
        self.stopped_early = False
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:  # a second signal: stop now
            self.uninstall()
            raise KeyboardInterrupt
        self.signum = signum

    def on_train_begin(self, args, state, control, **kwargs):
        if self.max_minutes:
            self.deadline = time.monotonic() + 60 * self.max_minutes

    def on_step_end(self, args, state, control, **kwargs):
        code = self.signum or 0
        if self.tracker is not None and self.tracker.failed:
            code = TRACKING_FAILED
        elif not code and self.validation is not None and self.validation.stop_requested:
            code = EARLY_STOP
        elif not code and self.deadline is not None and time.monotonic() >= self.deadline:
            code = EARLY_STOP  # training.max_minutes is up
        code = _max_over_ranks(code, args.device)
        if code == TRACKING_FAILED:
            self.reason = (self.tracker.failed if self.tracker is not None and self.tracker.failed
                           else "tracking failed on the main process")
        elif code == EARLY_STOP:
            self.stopped_early = True
        elif code and self.signum is None:
            self.signum = code  # another rank got the signal
        if code:
            control.should_save = code != EARLY_STOP or args.save_strategy != "no"
            control.should_training_stop = True
        return control


def _max_over_ranks(code: int, device) -> int:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return code
    import torch

    flag = torch.tensor([code], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


class NoSignalGuard(TrainerCallback):
    """training.no_signal: a run whose groups have no reward spread, or whose policy has collapsed, teaches GRPO
    nothing; stop it (with a checkpoint, through StopControl) and say why. Read from what TRL logs each step:
    `frac_reward_zero_std` (the share of flat groups), `reward` and `entropy`, which every rank logs alike, so every
    rank stops after the same step (its checkpoint saved first).
    - flat: over the last `patience` steps (more where they hold fewer than `min_groups` groups), at least
      `flat_share` of all groups were flat;
    - collapsed: the mean token entropy stayed below `min_entropy` for `patience` steps."""

    def __init__(self, stop: StopControl, flat_share: float, patience: int, min_groups: int, min_entropy: float,
                 groups_per_step: int):
        self.stop = stop
        self.flat_share, self.patience, self.min_entropy = flat_share, patience, min_entropy
        self.window = max(patience, math.ceil(min_groups / max(groups_per_step, 1)))  # steps
        self.steps: list[tuple[float, float | None, float | None]] = []  # (flat share, reward, entropy) per step
        self.diagnosis: str | None = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        flat = logs.get("frac_reward_zero_std")
        if flat is None or self.diagnosis is not None:
            return
        self.steps = [*self.steps, (float(flat), logs.get("reward"), logs.get("entropy"))][-self.window:]
        self.diagnosis = no_signal_diagnosis(self.steps, self.flat_share, self.patience, self.min_entropy,
                                             state.global_step)
        if self.diagnosis is not None:
            self.stop.reason = self.diagnosis  # the run ends FAILED with it; _fit names the checkpoint to resume
            control.should_save = control.should_training_stop = True
        return control


def no_signal_diagnosis(steps: list[tuple[float, float | None, float | None]], flat_share: float, patience: int,
                        min_entropy: float, step: int) -> str | None:
    """Why the last steps (flat share, mean reward, entropy) teach nothing, or None while they may."""
    rewards = [r for _, r, _ in steps[-patience:] if r is not None]
    entropies = [e for _, _, e in steps[-patience:] if e is not None]
    reward = sum(rewards) / len(rewards) if rewards else float("nan")
    entropy = sum(entropies) / len(entropies) if entropies else float("nan")
    fix = ("What to change: a larger generation.num_generations, a higher generation.temperature, or data of the "
           "right difficulty; `python -m grpo_pipeline check ...` (the env doctor) estimates the flat share per group "
           "size before a run. training.no_signal.enabled=false turns this check off.")
    collapsed = (min_entropy > 0 and len(entropies) >= patience and len(steps) >= patience
                 and all(e < min_entropy for e in entropies))
    if collapsed:
        return (f"no learning signal at step {step}: the policy's entropy stayed below training.no_signal.min_entropy="
                f"{min_entropy:g} for {patience} steps (mean {entropy:.4f}): it samples the same completion every "
                "time, so every group is flat. A KL term to the base model (loss.kl_coef, e.g. 0.04) or an entropy "
                "bonus (loss.entropy_coef) keeps a policy from collapsing; so does a lower learning rate. " + fix)
    if len(steps) < patience:
        return None
    flat = sum(f for f, _, _ in steps) / len(steps)
    if flat < flat_share:
        return None
    what = (f"every completion is right (mean reward {reward:.3f}): the data is too easy for this model now" if
            reward >= 0.98 else
            f"every completion is wrong (mean reward {reward:.3f}): the model never earns a reward to learn from" if
            reward <= 0.02 else
            f"the completions of each prompt score the same (mean reward {reward:.3f}, entropy {entropy:.3f}): "
            "near-identical samples, or a score too coarse to tell them apart")
    return (f"no learning signal at step {step}: {flat:.0%} of the groups of the last {len(steps)} steps had no reward "
            f"spread (training.no_signal.flat_share={flat_share:g}), so their advantages are all 0; {what}. " + fix)


class Diverged(PipelineError):
    """Training produced a non-finite loss, reward or gradient."""


class DivergenceGuard(TrainerCallback):
    """Stop the run at the first non-finite gradient, weight, loss or mean reward. A non-finite gradient stops it
    before the optimizer step writes it into the weights; an optimizer step that makes the weights non-finite
    (finite gradients times a huge learning rate) is undone from a copy of the trainable weights taken before it
    (LoRA adapters: a few MB; not taken above `SNAPSHOT_MAX` trainable parameters). So model-interrupted/ gets
    the last finite weights."""

    SNAPSHOT_MAX = 50_000_000

    def __init__(self, learning_rate: float):
        self.learning_rate = learning_rate
        self._before: list[torch.Tensor] | None = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        params = _trainable(model)
        grads = [p.grad for p in params if p.grad is not None]
        if grads and not finite(grads):
            raise Diverged(f"Training diverged at step {state.global_step + 1}: its gradients are not finite, so its "
                           f"optimizer step was not taken. {self.fix(state.global_step)}")
        small = sum(p.numel() for p in params) <= self.SNAPSHOT_MAX
        self._before = [p.detach().clone() for p in params] if small else None

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        params = _trainable(model)
        if params and not finite(params):
            kept = self._before is not None
            if kept:
                with torch.no_grad():
                    for p, before in zip(params, self._before, strict=True):
                        p.copy_(before)
            raise Diverged(f"Training diverged at step {state.global_step + 1}: its optimizer step made the weights "
                           f"non-finite{' (undone)' if kept else ''}. "
                           f"{self.fix(state.global_step) if kept else self.fix(0, weights_lost=True)}")

    def on_log(self, args, state, control, logs=None, **kwargs):
        for key in ("loss", "reward", "grad_norm"):
            value = (logs or {}).get(key)
            if isinstance(value, int | float) and not math.isfinite(value):
                raise Diverged(f"Training diverged at step {state.global_step}: {key} is {value}. "
                               f"{self.fix(state.global_step)}")

    def fix(self, steps_done: int, weights_lost: bool = False) -> str:
        kept = ("The weights before it are kept in model-interrupted/, the checkpoints saved so far in checkpoints/."
                if steps_done else "Nothing was trained yet." if not weights_lost else
                "The trained weights are not finite and not saved; the checkpoints saved so far are in checkpoints/.")
        return (f"{kept} Lower training.learning_rate (now {self.learning_rate:g}) or training.max_grad_norm; "
                "a reward component returning NaN/inf shows as reward.")


def _trainable(model) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad] if model is not None else []


def finite(tensors: list[torch.Tensor]) -> bool:
    """Every value finite (the largest magnitudes, not a norm: a norm of large finite values overflows)."""
    peaks = [t.detach().abs().amax().float() for t in tensors if t.numel()]
    return not peaks or bool(torch.isfinite(torch.stack(peaks)).all())
