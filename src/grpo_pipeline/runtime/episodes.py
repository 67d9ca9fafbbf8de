"""The env runtime: score a batch of episodes concurrently, with a per-episode timeout and a failure policy.

TRL calls reward functions once per generation batch, synchronously. `EpisodeRunner.reward_function()`
is such a function: it runs the env's `score_episode` for every completion of the batch on up to
`runtime.max_concurrency` daemon threads, so slow I/O-bound envs overlap, and a hung episode is
abandoned after `runtime.episode_timeout_s` instead of stalling the run (Python cannot kill a
thread; the abandoned one finishes in the background and its result is ignored).

Failure policy (`runtime.on_error`):
- `zero` : an exception or timeout scores 0 and is counted; more than `runtime.max_failures` in one
           run stops it with the first failure's traceback (a broken env fails fast, a flaky one
           does not kill a long run).
- `raise`: the first exception or timeout stops the run.
A score that is not a finite number in [0, 1] is a bug in the env and always stops the run.
"""

import math
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from grpo_pipeline.config.schema import RuntimeConfig
from grpo_pipeline.errors import EnvError
from grpo_pipeline.runtime.batching import GenerateBatcher


class PolicyHandle:
    """What the env receives as `model`: the live policy with gradients off for every call; its
    `generate` calls are merged with other episodes' by the batcher when there is one."""

    def __init__(self, model, batcher: GenerateBatcher | None = None):
        self._model = model
        self._batcher = batcher

    def generate(self, *args, **kwargs):
        if self._batcher is not None:
            return self._batcher.generate(*args, **kwargs)
        with torch.no_grad():
            return self._model.generate(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        with torch.no_grad():
            return self._model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


class Episode:
    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        self.value: Any = None
        self.error: BaseException | None = None
        self.started = 0.0
        self.seconds = 0.0
        self.done = False
        self.timed_out = False

    def run(self, changed: threading.Event) -> None:
        try:
            self.value = self.fn()
        except BaseException as e:  # reported to the caller with its traceback
            self.error = e
        finally:
            self.seconds = time.monotonic() - self.started
            self.done = True
            changed.set()


def run_bounded(fns: list[Callable[[], Any]], max_workers: int, timeout_s: float) -> list[Episode]:
    """Run fns on at most max_workers daemon threads; an fn running longer than timeout_s is abandoned."""
    episodes = [Episode(fn) for fn in fns]
    waiting = list(reversed(range(len(episodes))))
    running: set[int] = set()
    changed = threading.Event()
    while waiting or running:
        changed.clear()  # before the scan below: a completion after it still wakes the wait
        while waiting and len(running) < max(1, max_workers):
            i = waiting.pop()
            episodes[i].started = time.monotonic()
            threading.Thread(target=episodes[i].run, args=(changed,), daemon=True).start()
            running.add(i)
        now = time.monotonic()
        for i in list(running):
            ep = episodes[i]
            if ep.done:
                running.discard(i)
            elif now - ep.started >= timeout_s:
                ep.timed_out, ep.seconds = True, now - ep.started
                running.discard(i)
        if running:
            next_deadline = min(episodes[i].started + timeout_s for i in running)
            changed.wait(timeout=max(0.0, next_deadline - time.monotonic()))
    return episodes


def completion_text(completion: Any) -> str:
    """TRL gives text for text prompts and a list of messages for chat prompts; envs get text."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content") or "") for m in completion if m.get("role") == "assistant")


def score_problem(value: Any) -> str | None:
    """Why `value` is not a valid score, or None when it is one."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok and 0.0 <= value <= 1.0:
        return None
    return f"returned {value!r} ({type(value).__name__}); a score is a finite float in [0, 1]."


class EpisodeRunner:
    def __init__(self, env: Any, tokenizer, cfg: RuntimeConfig, extra_columns: list[str]):
        self.env = env
        self.env_name = type(env).__qualname__
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.extra_columns = list(extra_columns)
        self.max_workers = cfg.max_concurrency if getattr(env, "thread_safe", True) else 1
        self.model = None
        self.failures = 0
        self.timeouts = 0
        self._first_failure: str | None = None

    def bind(self, model) -> None:
        self.model = model

    def score(self, completions: list[str], rows: list[dict]) -> tuple[list[float], dict[str, float]]:
        """Scores for one batch under the failure policy, and the batch's runtime metrics."""
        episodes = self.run_episodes(completions, rows)
        scores = [self._outcome(ep, c, row) for ep, c, row in zip(episodes, completions, rows, strict=True)]
        seconds = [ep.seconds for ep in episodes]
        metrics = {
            "env/failures": float(self.failures),
            "env/timeouts": float(self.timeouts),
            "env/episode_seconds_mean": sum(seconds) / len(seconds),
            "env/episode_seconds_max": max(seconds),
        }
        return scores, metrics

    def run_episodes(self, completions: list[str], rows: list[dict]) -> list[Episode]:
        """Run score_episode for each completion (concurrently, batched generate, timeouts); raises nothing."""
        if self.model is None:
            raise RuntimeError("EpisodeRunner.bind(model) must be called before scoring.")
        batcher = None
        if self.cfg.batch_generate and self.max_workers > 1 and len(completions) > 1:
            batcher = GenerateBatcher(
                self.model,
                pad_token_id=getattr(self.tokenizer, "pad_token_id", None) or 0,
                eos_token_id=getattr(self.tokenizer, "eos_token_id", None),
                max_wait_s=self.cfg.batch_wait_ms / 1000,
            )
        policy = PolicyHandle(self.model, batcher)
        was_training = self.model.training
        self.model.eval()
        try:
            fns = [self._episode_fn(policy, batcher, c, row) for c, row in zip(completions, rows, strict=True)]
            episodes = run_bounded(fns, self.max_workers, self.cfg.episode_timeout_s)
        finally:
            if batcher is not None:
                batcher.close()
            self.model.train(was_training)
        return episodes

    def reward_function(self) -> Callable:
        """A TRL reward function (named after the env) that scores through this runner."""

        def reward(prompts, completions, log_metric=None, **columns):
            rows = [{k: columns[k][i] for k in self.extra_columns} for i in range(len(completions))]
            scores, metrics = self.score([completion_text(c) for c in completions], rows)
            if log_metric is not None:
                for name, value in metrics.items():
                    log_metric(name, value)
            return scores

        reward.__name__ = "env"
        return reward

    def _episode_fn(self, policy, batcher, completion: str, row: dict) -> Callable[[], Any]:
        def episode():
            if batcher is None:
                return self.env.score_episode(policy, self.tokenizer, completion, **row)
            batcher.episode_started()
            try:
                return self.env.score_episode(policy, self.tokenizer, completion, **row)
            finally:
                batcher.episode_ended()

        return episode

    def _outcome(self, ep: Episode, completion: str, row: dict) -> float:
        if ep.timed_out or ep.error is not None:
            if ep.timed_out:
                self.timeouts += 1
                what = f"timed out after {self.cfg.episode_timeout_s:g}s (runtime.episode_timeout_s)"
            else:
                what = "raised:\n" + "".join(traceback.format_exception(ep.error)).rstrip()
            self.failures += 1
            message = f"{self.env_name}.score_episode {what}\n{self._describe(completion, row)}"
            self._first_failure = self._first_failure or message
            if self.cfg.on_error == "raise":
                raise EnvError(message + "\nSet runtime.on_error=zero to score failed episodes 0 instead.")
            if self.failures > self.cfg.max_failures:
                raise EnvError(
                    f"{self.failures} episodes of {self.env_name} failed or timed out, more than "
                    f"runtime.max_failures={self.cfg.max_failures}. The first:\n{self._first_failure}"
                )
            return 0.0
        return self._check_score(ep.value, completion, row)

    def _check_score(self, value: Any, completion: str, row: dict) -> float:
        problem = score_problem(value)
        if problem:
            raise EnvError(f"{self.env_name}.score_episode {problem}\n{self._describe(completion, row)}")
        return float(value)

    @staticmethod
    def _describe(completion: str, row: dict) -> str:
        cols = {k: (v if len(repr(v)) < 120 else repr(v)[:117] + "...") for k, v in row.items()}
        return f"row (extra columns): {cols}\ncompletion starts: {completion[:200]!r}"
