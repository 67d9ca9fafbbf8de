"""The total reward of held-out episodes (eval.reward=total): what training maximises, summed as TRL sums it.

TRL's reward is sum(weight x reward function), a missing value counting 0 (1.16: nansum over the functions).
Held-out evaluation scores the env's score_episode alone by default (eval.reward=env); with eval.reward=total it
scores that sum over `reward.env_weight` x the env's score and every `reward.components` entry, each called as
TRL calls it: prompts, completions (text, or an assistant message for chat prompts), completion_ids (the text
re-tokenized) and the dataset's columns. An episode whose env scoring failed totals 0, like its env score.
"""

import math
from collections.abc import Callable
from typing import Any


class TotalReward:
    def __init__(self, env_weight: float, components: list[tuple[Callable, float]], tokenizer,
                 trainer_state: Any = None):
        """`components`: the reward functions besides the env's, with their weights (rewards/assemble.py)."""
        self.env_weight, self.components, self.tokenizer = float(env_weight), components, tokenizer
        self.trainer_state = trainer_state
        self.full = self.env_weight + sum(w for _, w in components)  # every part at its full score (1 each)

    def __call__(self, prompts: list, texts: list[str], rows: list[dict], env_scores: list[float],
                 failures: list) -> tuple[dict[str, list[float]], list[float]]:
        """The per-part scores ({"env": ..., <component>: ...}) and the totals, one per episode."""
        completions = [t if isinstance(p, str) else [{"role": "assistant", "content": t}]
                       for p, t in zip(prompts, texts, strict=True)]
        columns = {k: [row[k] for row in rows] for k in (rows[0] if rows else {})}
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        parts: dict[str, list[float]] = {"env": list(env_scores)}
        totals = [self.env_weight * s for s in env_scores]
        for fn, weight in self.components:
            values = fn(prompts=list(prompts), completions=completions, completion_ids=ids, **columns,
                        trainer_state=self.trainer_state, log_metric=_ignore, log_extra=_ignore)
            values = [_finite(v) for v in values]
            parts[fn.__name__] = values
            totals = [t + weight * v for t, v in zip(totals, values, strict=True)]
        return parts, [0.0 if failed else t for t, failed in zip(totals, failures, strict=True)]


def _finite(value) -> float:
    return float(value) if value is not None and math.isfinite(value) else 0.0


def _ignore(*_args, **_kwargs) -> None:
    """TRL's log_metric / log_extra: nothing to log for a held-out episode."""
