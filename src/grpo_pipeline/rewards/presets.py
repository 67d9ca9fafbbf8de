"""Reward components from the well-known GRPO tutorials, for `reward.components` (see conf/reward/).

Each is a TRL-style reward function: `fn(prompts, completions, **columns_and_kwargs) -> list[float]`,
each value in [0, 1]. Arguments without defaults after `completions` name dataset columns the
component needs (checked at startup).
"""

import re

from grpo_pipeline.envs.runner import completion_text

_TAG = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)
_FINAL = re.compile(r"final answer\s*[:：]\s*(\S+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_STEP = re.compile(r"^\s*(?:step\s*\d+\s*[:.)]?|\d+[.)]|[-*•])\s", re.IGNORECASE | re.MULTILINE)


def extract_answer(text: str) -> str | None:
    """The answer in <answer>...</answer>, else after 'Final Answer:', else the last number."""
    for pattern in (_TAG, _FINAL):
        found = pattern.findall(text)
        if found:
            return found[-1].strip().rstrip(".")
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _same(a: str | None, b) -> bool:
    if a is None:
        return False
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return a.strip().lower() == str(b).strip().lower()


def accuracy(prompts, completions, answer, **_) -> list[float]:
    """1.0 when the extracted answer equals the row's `answer` column, else 0.0."""
    return [float(_same(extract_answer(completion_text(c)), a)) for c, a in zip(completions, answer, strict=True)]


def length_penalty(prompts, completions, completion_ids=None, target_length: int = 200, **_) -> list[float]:
    """1.0 up to `target_length` completion tokens, then linearly down to 0.0 at twice the target."""
    lengths = [len(ids) for ids in completion_ids] if completion_ids is not None else [
        len(completion_text(c).split()) for c in completions]
    return [1.0 if n <= target_length else max(0.0, 1.0 - (n - target_length) / target_length) for n in lengths]


def step(prompts, completions, step_bonus: float = 0.1, **_) -> list[float]:
    """`step_bonus` per reasoning step (lines starting 'Step N', 'N.', 'N)' or a bullet), capped at 1.0."""
    return [min(1.0, step_bonus * len(_STEP.findall(completion_text(c)))) for c in completions]
