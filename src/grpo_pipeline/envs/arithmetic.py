"""Single-turn arithmetic with a verifiable answer.

The prompt asks for the result inside <answer>...</answer> and shows `num_shot` worked examples
("59 + 63 = 122" then the tag), so a small instruct model gets credit from the first step: zero-shot,
SmolLM2-135M never writes the tags and every reward is 0; asked for the bare tag it guesses without
writing the sum and is almost never right (measured: 0/8); with the echoed equation it writes the tag
97% of the time and is right 30% of the time. Score: `format_weight` for a well-formed tag + `answer_weight` for the
right value, read from the tag, else from the last number in the reply (models echo the operands).
Nothing the model writes is evaluated as code.
"""

import random
import re

from datasets import Dataset

_TAG = re.compile(r"<answer>\s*(-?\d+(?:\.\d+)?)\s*</answer>")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

INSTRUCTION = "Give the final result as <answer>N</answer>."


class ArithmeticEnv:
    thread_safe = True

    def __init__(
        self,
        num_samples: int = 2000,
        min_value: int = 10,
        max_value: int = 99,
        operations: list[str] | tuple[str, ...] = ("+",),
        num_shot: int = 1,
        format_weight: float = 0.2,
        answer_weight: float = 0.8,
        seed: int = 0,
    ):
        unknown = [op for op in operations if op not in _OPS]
        if unknown:
            raise ValueError(f"operations {unknown} are not supported; use some of {list(_OPS)}")
        if min_value > max_value:
            raise ValueError(f"min_value ({min_value}) > max_value ({max_value})")
        if abs(format_weight + answer_weight - 1.0) > 1e-9 or min(format_weight, answer_weight) < 0:
            raise ValueError("format_weight and answer_weight must be >= 0 and sum to 1")
        self.num_samples = num_samples
        self.min_value, self.max_value = min_value, max_value
        self.operations = list(operations)
        self.num_shot = num_shot
        self.format_weight, self.answer_weight = format_weight, answer_weight
        self.seed = seed

    def _problem(self, rng: random.Random) -> tuple[str, int]:
        a, b = rng.randint(self.min_value, self.max_value), rng.randint(self.min_value, self.max_value)
        op = rng.choice(self.operations)
        return f"What is {a} {op} {b}?", _OPS[op](a, b)

    def build_dataset(self, tokenizer) -> Dataset:
        rng = random.Random(self.seed)
        shots = []
        for _ in range(self.num_shot):
            question, answer = self._problem(rng)
            shots += [
                {"role": "user", "content": f"{question} {INSTRUCTION}"},
                {"role": "assistant", "content": f"{question[8:-1]} = {answer}\n<answer>{answer}</answer>"},
            ]
        rows, seen = [], set()
        while len(rows) < self.num_samples:
            question, answer = self._problem(rng)
            if question in seen and len(seen) < self._num_distinct():
                continue
            seen.add(question)
            prompt = shots + [{"role": "user", "content": f"{question} {INSTRUCTION}"}]
            rows.append({"prompt": prompt, "answer": answer})
        return Dataset.from_list(rows)

    def _num_distinct(self) -> int:
        return (self.max_value - self.min_value + 1) ** 2 * len(self.operations)

    def score_episode(self, model, tokenizer, completion: str, answer: int, **_) -> float:
        tagged = _TAG.findall(completion)
        if tagged:
            value, score = tagged[-1], self.format_weight
        else:
            numbers = _NUMBER.findall(completion)
            value, score = (numbers[-1] if numbers else None), 0.0
        if value is not None and float(value) == float(answer):
            score += self.answer_weight
        return score
