"""What a failed episode costs: the run's failure budget, and its place in the GRPO advantage.

A failed or timed-out training episode scores 0, but that 0 is not a reward the completion earned.
- The run stops when more than `runtime.max_failure_rate` of the last `runtime.failure_window` training
  episodes failed (a flaky env survives a long run, a burst of failures stops it), or when every
  episode of the first two batches failed (the env looks broken).
- In the reward TRL sees, a failed episode gets the mean score of its group's successful episodes, so its
  advantage is 0 and the others keep their ranking; a group where every episode failed is flat (no signal).
"""

from collections import deque

from grpo_pipeline.errors import EnvError

BROKEN_AFTER_BATCHES = 2


class FailureBudget:
    def __init__(self, env_name: str, max_failure_rate: float, failure_window: int):
        self.env_name = env_name
        self.rate = max_failure_rate
        self.window = failure_window
        self.recent: deque[str | None] = deque(maxlen=failure_window)  # a failure's message, None for a success
        self.batches = 0
        self.episodes = 0
        self.any_success = False
        self.first_failure: str | None = None

    def record(self, outcomes: list[str | None]) -> None:
        """Add one training batch (a failure message or None per episode); raise EnvError to stop the run."""
        self.batches += 1
        self.episodes += len(outcomes)
        self.any_success = self.any_success or any(o is None for o in outcomes)
        self.first_failure = self.first_failure or next((o for o in outcomes if o is not None), None)
        self.recent.extend(outcomes)
        if not self.any_success and self.batches >= BROKEN_AFTER_BATCHES:
            raise EnvError(
                f"Every episode of the first {self.batches} batches of {self.env_name} failed or timed out "
                f"({self.episodes} episodes): the env looks broken (this stop does not wait for "
                f"runtime.max_failure_rate / runtime.failure_window). The first:\n{self.first_failure}"
            )
        failed = [o for o in self.recent if o is not None]
        limit = self.rate * self.window
        if len(failed) > limit:
            raise EnvError(
                f"{len(failed)} of the last {len(self.recent)} episodes of {self.env_name} failed or timed out, "
                f"more than runtime.max_failure_rate={self.rate:g} x runtime.failure_window={self.window} = "
                f"{limit:g}. Fix the env, or raise runtime.max_failure_rate if it fails this often by design. "
                f"The first of them:\n{failed[0]}"
            )
