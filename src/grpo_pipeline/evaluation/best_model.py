"""Validation during training: score the validation prompts every `eval.every_steps`, keep the best weights,
optionally stop early.

- The scores go into the Trainer's log history (so a checkpoint carries them, like TRL's metrics) and to
  MLflow as `eval_val/mean_reward` and `eval_val/success_rate`, with the KL to the base model over the
  validation completions as `eval_val/kl_to_base` (evaluation/kl_to_base.py; a warning above 0.5).
- On a new best (highest validation mean reward) the trainable weights (the LoRA adapter, or every weight
  without LoRA) are written to `<run dir>/best/step-<N>.safetensors`. At the end `model/` gets them only if the
  best step beat the last one by more than `margin` paired standard errors over the validation prompts (the
  highest of several noisy scores is partly luck); otherwise the last weights. `model-last/` is the last.
- Evaluating never changes the training trajectory: generation is greedy and the RNG states are restored.
- Resume: the best step, its score and the patience counter are stored in every checkpoint's
  trainer_state.json and restored from it.

Not transformers' `EarlyStoppingCallback` + `load_best_model_at_end`: those read `Trainer.evaluate`'s metric
(TRL's eval samples num_generations per prompt) and reload a whole checkpoint, where this scores greedily on the
env, keeps only the trainable weights and applies the margin rule (docs/layout.md, "Library or hand-written").
"""

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers.trainer_callback import ExportableState, TrainerCallback

from grpo_pipeline.evaluation.heldout import paired_gain
from grpo_pipeline.evaluation.kl_to_base import warn_if_drifting
from grpo_pipeline.training.checkpoints import fsync_file

log = logging.getLogger(__name__)
PREFIX = "eval_val"


def trainable_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().to("cpu", copy=True).contiguous() for n, p in model.named_parameters() if p.requires_grad}


class Validation(TrainerCallback, ExportableState):
    def __init__(self, evaluate: Callable[[], dict], every_steps: int, patience: int, best_dir: Path | None,
                 policy, tracker=None, margin: float = 0.0):
        self.evaluate, self.every_steps, self.patience = evaluate, every_steps, patience
        self.best_dir, self.policy, self.tracker, self.margin = best_dir, policy, tracker, margin
        self.best_step: int | None = None
        self.best_score: float | None = None
        self.best_scores: list[float] | None = None  # per validation prompt
        self.last_step: int | None = None
        self.last_score: float | None = None
        self.last_scores: list[float] | None = None
        self.without_improvement = 0
        self.kept_step: int | None = None  # the step whose weights model/ holds (set when the models are saved)
        self.stop_requested = False
        self.history: list[tuple[int, float]] = []
        self.seconds = 0.0  # spent validating

    def state(self) -> dict:
        return {"args": {}, "attributes": {k: getattr(self, k) for k in
                                           ("best_step", "best_score", "best_scores", "last_step", "last_score",
                                            "last_scores", "without_improvement", "history", "seconds")}}

    def restore(self, stored: dict | None) -> None:
        for key, value in ((stored or {}).get("attributes") or {}).items():
            setattr(self, key, [tuple(x) for x in value] if key == "history" else value)

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if step % self.every_steps == 0 or step == state.max_steps:
            self.validate(state)
        return control

    def validate(self, state) -> None:
        """Score the validation prompts at the current step (also called when training stopped between
        validations, e.g. training.max_minutes: the summary then names the step of the weights it saved)."""
        step = state.global_step
        started = time.monotonic()
        metrics = self.evaluate()
        self.seconds += time.monotonic() - started
        score = metrics["mean_reward"]
        self.last_step, self.last_score, self.last_scores = step, score, metrics.get("scores")
        self.history.append((step, score))
        values = {f"{PREFIX}/mean_reward": score, f"{PREFIX}/success_rate": metrics["success_rate"]}
        if metrics.get("kl_to_base") is not None:  # evaluation/kl_to_base.py
            values[f"{PREFIX}/kl_to_base"] = metrics["kl_to_base"]
            warn_if_drifting(metrics["kl_to_base"], step)
        state.log_history.append({**values, "step": step})
        if self.tracker is not None:
            self.tracker.log_metrics(values, step=step)
        if self.best_score is None or score > self.best_score:
            self.best_step, self.best_score, self.best_scores, self.without_improvement = step, score, self.last_scores, 0
            self._save_best(step)
        else:
            self.without_improvement += 1
            if self.patience and self.without_improvement >= self.patience:
                log.warning("validation: no improvement over %.3f (step %d) for %d evaluations: stopping early.",
                            self.best_score, self.best_step, self.without_improvement)
                self.stop_requested = True

    def _save_best(self, step: int) -> None:
        if self.best_dir is None:
            return
        self.best_dir.mkdir(parents=True, exist_ok=True)
        path = self.best_dir / f"step-{step}.safetensors"
        save_file(trainable_state(self.policy), str(path.with_suffix(".tmp")))
        fsync_file(path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)  # a kill never leaves a half-written best
        self.prune()  # full fine-tuning writes whole models here: keep only what can still be chosen

    def model_step(self) -> tuple[int | None, str]:
        """The step whose weights model/ keeps, and why: the best validation step's only if it beat the last
        step by more than `margin` paired standard errors over the validation prompts, else the last step's."""
        if self.best_step is None or self.best_step == self.last_step:
            return self.last_step, "the best validation step is the last"
        if not self.best_scores or not self.last_scores or len(self.best_scores) != len(self.last_scores):
            return self.best_step, "the best validation step (no per-prompt scores to compare it with the last)"
        gain, se = paired_gain(self.last_scores, self.best_scores)
        versus = f"{gain:+.3f} +- {se or 0:.3f} over the last step {self.last_step}'s {self.last_score:.3f}"
        if gain > self.margin * (se or 0.0):
            return self.best_step, f"the best validation step: {versus}, more than {self.margin:g} standard errors"
        return self.last_step, (f"the last step: the best validation step {self.best_step} ({self.best_score:.3f}) "
                                f"scored {versus}, within {self.margin:g} standard errors")

    def restore_best(self) -> bool:
        """Load the best step's weights into the policy; False when there are none to load."""
        if self.best_dir is None or self.best_step is None:
            return False
        path = self.best_dir / f"step-{self.best_step}.safetensors"
        if not path.exists():
            log.error("validation: the best weights (step %d) are missing from %s; keeping the last weights.",
                      self.best_step, self.best_dir)
            return False
        tensors = load_file(str(path))
        missing = set(trainable_state(self.policy)) - set(tensors)
        if missing:
            raise RuntimeError(f"{path} lacks {len(missing)} trainable tensors, e.g. {sorted(missing)[:3]}")
        self.policy.load_state_dict(tensors, strict=False)
        return True

    def prune(self) -> None:
        """Keep only the best step's weights file (also when model/ holds the last step's: a run extended later
        may still choose it), and those a checkpoint names as its best (a resume from it may need them)."""
        if self.best_dir is None or not self.best_dir.is_dir():
            return
        keep = {self.best_step, *_best_steps_of_checkpoints(self.best_dir.parent)}
        for path in self.best_dir.glob("step-*.safetensors"):
            if path.name not in {f"step-{s}.safetensors" for s in keep}:
                path.unlink(missing_ok=True)


def _best_steps_of_checkpoints(run_dir: Path) -> set[int]:
    steps = set()
    for state_file in (run_dir / "checkpoints").glob("checkpoint-*/trainer_state.json"):
        try:
            stored = json.loads(state_file.read_text())["stateful_callbacks"]["Validation"]["attributes"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(stored.get("best_step"), int):
            steps.add(stored["best_step"])
    return steps
