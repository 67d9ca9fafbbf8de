"""The env runtime: score a batch of episodes concurrently, with a per-episode timeout and a failure policy.

TRL calls reward functions once per generation batch, synchronously. `EpisodeRunner.reward_function()`
is such a function: it runs the env's `score_episode` for every completion of the batch on up to
`runtime.max_concurrency` daemon threads, so slow I/O-bound envs overlap, and a hung episode is
abandoned after `runtime.episode_timeout_s` instead of stalling the run. Python cannot kill a thread:
an abandoned episode runs on in the background, but its model handle is revoked (see policy.py), and
model calls still in flight when the batch ends finish before the reward function returns, so the
trainer never updates weights under an env's generate. An env with `thread_safe = False` runs one
episode at a time, abandoned ones included (a lock held across batches).

Failure policy (`runtime.on_error`):
- `zero` : an exception or timeout scores 0 and is counted; the run stops when more than
           `runtime.max_failure_rate` of the last `runtime.failure_window` training episodes failed, or
           when every episode of the first two batches failed (failures.py). In the reward TRL sees, a
           failed episode is None (unscorable): out of its group's baseline, advantage 0.
- `raise`: the first exception or timeout stops the run.
A score that is not a finite number in [0, 1] is a bug in the env and always stops the run.
`score(..., evaluation=True)` (held-out evaluation) scores env turns greedily, counts its failures
apart, and never stops the run for them.
"""

import math
import random
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from grpo_pipeline.config.schema import RuntimeConfig
from grpo_pipeline.envs.batching import GenerateBatcher, ServingEvent
from grpo_pipeline.envs.bounded import Episode, run_bounded
from grpo_pipeline.envs.failures import FailureBudget
from grpo_pipeline.envs.loader import env_name, takes_episode_seed
from grpo_pipeline.envs.policy import EpisodeAbandoned, InFlight, PolicyHandle
from grpo_pipeline.envs.recorder import CallRecorder
from grpo_pipeline.envs.shared_tokenizer import shared
from grpo_pipeline.errors import EnvError

GREEDY = {"do_sample": False}

__all__ = ["Episode", "EpisodeAbandoned", "EpisodeRunner", "PolicyHandle", "completion_text", "score_problem"]


def completion_text(completion: Any) -> str:
    """TRL gives text for text prompts and a list of messages for chat prompts; envs get text."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content") or "") for m in completion if m.get("role") == "assistant")


def carried_seeds(completions: list[Any]) -> list[int | None]:
    """Each episode's `episode_seed` as its rollout drew it (a multi-turn transcript carries it), else None."""
    return [getattr(c, "episode_seed", None) for c in completions]


def as_real(value: Any) -> float | None:
    """A plain real number (ints, floats, numpy scalars, 0-d numpy arrays and tensors), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    shape, item = getattr(value, "shape", None), getattr(value, "item", None)
    if callable(item) and (shape == () or shape is None and type(value).__module__ == "numpy"):
        try:
            number = item()
        except (TypeError, ValueError, RuntimeError):
            return None
        return float(number) if isinstance(number, int | float) and not isinstance(number, bool) else None
    return None


def score_problem(value: Any) -> str | None:
    """Why `value` is not a valid score, or None when it is one."""
    number = as_real(value)
    if number is not None and math.isfinite(number) and 0.0 <= number <= 1.0:
        return None
    return f"returned {value!r} ({type(value).__name__}); a score is a finite real number in [0, 1]."


class EpisodeRunner:
    def __init__(self, env: Any, tokenizer, cfg: RuntimeConfig, extra_columns: list[str],
                 sampling: dict | None = None, seed: int | str | None = None):
        """`sampling`: generate settings for the env's turns in training (e.g. {"do_sample": True,
        "temperature": 0.7, "top_k": 0, "top_p": 1.0}), filled into calls that do not set them. `seed` (the run's and
        the process's): where the env's methods take an `episode_seed`, each training episode's is drawn from it."""
        self.env = env
        self.env_name = env_name(env)
        self.tokenizer = shared(tokenizer)  # env threads share it: one call at a time (shared_tokenizer.py)
        self.cfg = cfg
        self.extra_columns = list(extra_columns)
        self.sampling = dict(sampling or {})
        self.last_batch: dict[str, list] = {"seconds": [], "failures": []}  # the last scored batch, for the ledger
        thread_safe = getattr(env, "thread_safe", True)
        self.max_workers = cfg.max_concurrency if thread_safe else 1
        self._exclusive = None if thread_safe else threading.Lock()  # held by the running episode, across batches
        self._holder: Episode | None = None  # the episode holding it
        self._stuck: Episode | None = None  # an abandoned holder that made another episode time out waiting
        self.model = None
        # the runtime's decode loop on its sampling copy, for the env's recorded calls (set by rollout/turns.py)
        self.fast_generate = None
        self.fast_generate_done = None  # called once a training batch's episodes are scored
        self.failures = self.timeouts = 0  # training episodes, whole run
        self.eval_failures = self.eval_timeouts = 0
        self.budget = FailureBudget(self.env_name, cfg.max_failure_rate, cfg.failure_window)
        # env methods that declare `episode_seed`: each training episode gets its own (one draw for all its calls),
        # a held-out episode None (the env plays it the same way every time)
        self.seeded = {m: takes_episode_seed(env, m) for m in ("respond", "score_turn", "score_episode")}
        self._seed_rng = random.Random(seed)

    def draw_episode_seeds(self, n: int) -> list[int | None]:
        """Seeds for `n` new training episodes (None each when no env method takes one)."""
        return [self._seed_rng.getrandbits(31) for _ in range(n)] if any(self.seeded.values()) else [None] * n

    def seed_kwargs(self, method: str, seed: int | None) -> dict:
        """The keyword `env.<method>` gets for an episode's seed: {"episode_seed": seed} where it declares one."""
        return {"episode_seed": seed} if self.seeded.get(method) else {}

    def bind(self, model) -> None:
        self.model = model

    def score(self, completions: list[Any], rows: list[dict], evaluation: bool = False,
              pre_failures: list[str | None] | None = None) -> tuple[list[float], dict[str, float]]:
        """Scores for one batch (failed episodes 0.0) and the batch's runtime metrics, under the failure
        policy. With evaluation=True: greedy env turns, `eval/` counters, no stop for failures.
        A completion is text, or a multi-turn episode's messages; `pre_failures` marks episodes whose env
        calls already failed during the rollout (they are not scored, they count as failures)."""
        scores, _, metrics = self._score(completions, rows, evaluation, pre_failures)
        return scores, metrics

    def reward_function(self) -> Callable:
        """A TRL reward function (named after the env) that scores through this runner. A failed episode's
        reward is None: TRL 1.16 leaves it out of its group's (NaN-aware) mean and std and gives it advantage 0,
        across processes too. `reward.failed` holds the last batch's failures, for the other reward components
        (rewards/assemble.py) called on the same batch, so that a failed episode is unscorable as a whole, not
        scored by its format alone."""

        def reward(prompts, completions, log_metric=None, log_extra=None, **columns):
            rows = [{k: columns[k][i] for k in self.extra_columns} for i in range(len(completions))]
            if "transcript" in columns:  # multi-turn episodes the runtime generated (rollout.py)
                episodes, pre_failures = columns["transcript"], columns["episode_failure"]
            else:
                episodes, pre_failures = [completion_text(c) for c in completions], None
            scores, failed, metrics = self._score(episodes, rows, False, pre_failures, columns.get("episode_ids"))
            if log_metric is not None:
                for name, value in metrics.items():
                    log_metric(name, value)
            if log_extra is not None:  # for the episode ledger (TRL gathers these across processes)
                log_extra("seconds", self.last_batch["seconds"])
                log_extra("failure", self.last_batch["failures"])
                for key in ("transcript", "opening"):
                    if key in columns:
                        log_extra(key, columns[key] if key == "opening" else episodes)
            reward.failed = (completions, list(failed))  # the batch (TRL hands every reward the same list)
            return [None if f else s for s, f in zip(scores, failed, strict=True)]

        reward.__name__ = "env"
        reward.failed = (None, [])
        return reward

    def run_episodes(self, completions: list[Any], rows: list[dict], sampling: dict | None = None,
                     skip: list[bool] | None = None, recorders: list | None = None,
                     seeds: list[int | None] | None = None) -> list[Episode]:
        """Run score_episode for each completion (concurrently, batched generate, timeouts); raises nothing.
        `recorders` (one CallRecorder per episode, or None): keep what each episode's generate calls sampled.
        `seeds`: each episode's `episode_seed` (None: a held-out episode's), for an env whose score_episode takes it.
        Returns once no env model call is running (every episode's model handle is revoked by then); raises
        EnvError only when a call still runs runtime.call_deadline_s after the batch ended."""
        if self.model is None:
            raise RuntimeError("EpisodeRunner.bind(model) must be called before scoring.")
        batcher = None
        if self.cfg.batch_generate and self.max_workers > 1 and len(completions) > 1:
            batcher = GenerateBatcher(
                self.model,
                pad_token_id=getattr(self.tokenizer, "pad_token_id", None) or 0,
                eos_token_id=getattr(self.tokenizer, "eos_token_id", None),
                max_wait_s=self.cfg.batch_wait_ms / 1000,
                fast=self.fast_generate if recorders is not None else None,
                worker=False,  # this thread serves the calls while it waits for the episodes (ServingEvent)
            )
        in_flight = InFlight()
        sampling = self.sampling if sampling is None else sampling
        recorders = recorders or [None] * len(rows)
        handles = [PolicyHandle(self.model, in_flight, f"episode {i} ({_preview(row)})", batcher, sampling,
                                self.cfg.max_call_tokens, recorder) for i, (row, recorder) in
                   enumerate(zip(rows, recorders, strict=True))]
        was_training = self.model.training
        self.model.eval()
        try:
            skip = skip or [False] * len(rows)
            seeds = seeds or carried_seeds(completions)
            fns = [(lambda ep: None) if s else self._episode_fn(h, c, row | self.seed_kwargs("score_episode", seed))
                   for h, c, row, s, seed in zip(handles, completions, rows, skip, seeds, strict=True)]
            episodes = run_bounded(fns, self.max_workers, self.cfg.episode_timeout_s,
                                   on_start=lambda i: handles[i].join_batcher(),  # the batcher waits for the wave
                                   on_timeout=lambda i: handles[i].revoke(self._abandoned(i)),
                                   changed=ServingEvent(batcher) if batcher is not None else None)
        finally:
            for i, handle in enumerate(handles):
                handle.revoke(f"episode {i} of {self.env_name} ended with its batch (the batch was scored); "
                              "it can no longer use the model. Keep no reference to `model` beyond score_episode.")
            if batcher is not None and in_flight.count:
                batcher.start_worker()  # calls of abandoned episodes still running: nobody else serves them
            try:
                in_flight.wait_idle(self.cfg.call_deadline_s)  # raises past the deadline: the run stops
            finally:
                if batcher is not None and not in_flight.count:
                    batcher.close()  # (a stuck call would make close wait for it too)
                self.model.train(was_training)
        return episodes

    def _abandoned(self, i: int) -> str:
        return (f"episode {i} of {self.env_name} was abandoned after its timeout (runtime.episode_timeout_s="
                f"{self.cfg.episode_timeout_s:g}); it can no longer use the model.")

    def _episode_fn(self, handle: PolicyHandle, completion: str, row: dict) -> Callable[[Episode], Any]:
        def episode(ep: Episode):
            try:
                return self._exclusively(ep, lambda: self.env.score_episode(handle, self.tokenizer, completion, **row),
                                         lambda: handle.revoked)
            finally:
                handle.leave_batcher()

        return episode

    def call_env(self, calls: list[Callable[[], Any]], method: str, rows: list[dict], texts: list[str]
                 ) -> list[tuple[Any, str | None, float]]:
        """Run env calls (e.g. `respond`) of several episodes at once under the runtime's rules: at most
        runtime.max_concurrency threads, runtime.episode_timeout_s each, one at a time for a non-thread-safe
        env. Returns (value, failure message or None, seconds) per call; raises nothing."""
        fns = [lambda ep, call=call: self._exclusively(ep, call) for call in calls]
        episodes = run_bounded(fns, self.max_workers, self.cfg.episode_timeout_s)
        out = []
        for ep, row, text in zip(episodes, rows, texts, strict=True):
            failure = self._failure(ep, text, row, method)
            out.append((None if failure else ep.value, failure, ep.seconds))
        return out

    def _exclusively(self, ep: Episode, call: Callable[[], Any], revoked: Callable[[], bool] = lambda: False) -> Any:
        """An env call, holding the env's lock when it is not thread-safe."""
        if self._exclusive is None:
            return call()
        ep.waiting_for_lock = True  # time spent here counts toward the episode's timeout
        if self._stuck is not None and self._stuck is self._holder:  # it already cost one episode a timeout
            ep.timed_out = ep.timed_out_waiting = True
            return None
        left = ep.started + self.cfg.episode_timeout_s - time.monotonic()
        if not self._exclusive.acquire(timeout=max(0.0, left)):
            self._stuck = self._holder
            ep.timed_out = ep.timed_out_waiting = True
            return None
        self._holder, ep.waiting_for_lock = ep, False
        try:
            return None if revoked() else call()
        finally:
            self._holder = None
            self._exclusive.release()

    def _score(self, completions, rows, evaluation: bool, pre_failures: list[str | None] | None = None,
               episode_ids: list[list[int]] | None = None) -> tuple[list[float], list[bool], dict[str, float]]:
        """`pre_failures`: episodes that already failed before scoring (an env call of a multi-turn rollout).
        `episode_ids`: each episode's tokens as sampled (prompt + first reply), where the rollout gave them."""
        pre_failures = pre_failures or [None] * len(rows)
        # training: what the env's own generate calls sample is recorded, to be trained (runtime.train_env_calls)
        recorders = None
        if not evaluation and self.cfg.train_env_calls and self.sampling.get("do_sample"):
            episode_ids = episode_ids or [None] * len(rows)
            recorders = [CallRecorder(self.sampling, ids, self.tokenizer) for ids in episode_ids]
        # a training episode's seed: the one its rollout drew (it rides with the transcript), else a new one
        seeds = [None] * len(completions) if evaluation else carried_seeds(completions)
        if not evaluation and None in seeds:
            drawn = iter(self.draw_episode_seeds(seeds.count(None)))
            seeds = [next(drawn) if s is None else s for s in seeds]
        try:
            episodes = self.run_episodes(completions, rows, GREEDY if evaluation else None,
                                         skip=[f is not None for f in pre_failures], recorders=recorders, seeds=seeds)
        finally:
            if recorders is not None and self.fast_generate_done is not None:
                self.fast_generate_done()  # the rollout's episode caches are not needed any more
        failures = [pre or self._failure(ep, c, row)
                    for ep, c, row, pre in zip(episodes, completions, rows, pre_failures, strict=True)]
        scores = [0.0 if f else self._check_score(ep.value, c, row)
                  for ep, f, c, row in zip(episodes, failures, completions, rows, strict=True)]
        timeouts = sum(ep.timed_out for ep in episodes)
        failed = [f is not None for f in failures]
        seconds = [ep.seconds for ep in episodes]
        self.last_batch = {"seconds": seconds, "failures": [_first_line(f, ep, pre) for f, ep, pre in
                                                            zip(failures, episodes, pre_failures, strict=True)]}
        if recorders is not None:  # a failed episode's samples are not trained (it has no advantage)
            self.last_batch["turn_samples"] = [[] if f else r.samples for f, r in zip(failures, recorders, strict=True)]
            self.last_batch["turn_samples_skipped"] = sum(r.skipped for r in recorders)
            self.last_batch["turn_calls_rebased"] = sum(r.rebased_calls for r in recorders)
        metrics = {"episode_seconds_mean": sum(seconds) / len(seconds), "episode_seconds_max": max(seconds)}
        if evaluation:
            self.eval_failures += sum(failed)
            self.eval_timeouts += timeouts
            metrics |= {"failures": float(sum(failed)), "timeouts": float(timeouts)}
            return scores, failed, {f"eval/{k}": v for k, v in metrics.items()}
        self.failures += sum(failed)
        self.timeouts += timeouts
        first = next((f for f in failures if f), None)
        if first and self.cfg.on_error == "raise":
            raise EnvError(first + "\nSet runtime.on_error=zero to score failed episodes 0 instead.")
        self.budget.record(failures)
        metrics |= {"failures": float(self.failures), "failures_in_batch": float(sum(failed)),
                    "timeouts": float(self.timeouts)}
        return scores, failed, {f"env/{k}": v for k, v in metrics.items()}

    def _failure(self, ep: Episode, completion: Any, row: dict, method: str = "score_episode") -> str | None:
        """Why the episode failed (with its traceback, row and completion), or None."""
        if ep.timed_out_waiting:
            what = (f"timed out after {self.cfg.episode_timeout_s:g}s (runtime.episode_timeout_s) waiting for an "
                    "abandoned episode of this non-thread-safe env (thread_safe = False) to finish; its episodes "
                    "run one at a time")
        elif ep.timed_out:
            what = f"timed out after {self.cfg.episode_timeout_s:g}s (runtime.episode_timeout_s)"
        elif ep.error is not None:
            what = "raised:\n" + "".join(traceback.format_exception(ep.error)).rstrip()
        else:
            return None
        return f"{self.env_name}.{method} {what}\n{self._describe(completion, row)}"

    def _check_score(self, value: Any, completion: str, row: dict) -> float:
        problem = score_problem(value)
        if problem:
            raise EnvError(f"{self.env_name}.score_episode {problem}\n{self._describe(completion, row)}")
        return as_real(value)

    @staticmethod
    def _describe(completion: Any, row: dict) -> str:
        cols = {k: (v if len(repr(v)) < 120 else repr(v)[:117] + "...") for k, v in row.items()}
        text = completion if isinstance(completion, str) else completion_text(completion)
        return f"row (extra columns): {cols}\ncompletion starts: {text[:200]!r}"


def _preview(row: dict) -> str:
    text = repr(row)
    return "row " + (text if len(text) <= 80 else text[:77] + "...")



def _first_line(failure: str | None, ep: Episode, pre: str | None) -> str | None:
    """A failure in one line, for the episode ledger: the exception, the timeout or the rollout's error."""
    if not failure:
        return None
    if pre is None and ep.error is not None:
        message = str(ep.error).strip()
        return f"{ep.error.__class__.__name__}: {message.splitlines()[0] if message else ''}"[:300]
    return failure.strip().splitlines()[0][:300]
