"""A small text game written as a TRL environment (TRL 1.16's `environment_factory` contract), with no import
from this project: the example that `env=trl` runs (python -m grpo_pipeline env=trl).

The env thinks of a whole number; the model finds it with the `guess` tool, which answers higher, lower or
correct. TRL's contract: `reset(**row)` starts an episode and returns text appended to the prompt's last message;
every public method is a tool (its schema is built from the type hints and the Google-style docstring);
`get_reward()` scores the episode from the instance's state.

`openings()` is the dataset `env=trl` names for it: each row's prompt is one worked game (the model's calls and the
env's answers) and an empty user message, which reset() fills with the new game. Without the worked game
SmolLM2-135M never writes a tool call (0 of 32 episodes, every score 0); with it, 28% of episodes guess and
groups have reward spread (`python -m grpo_pipeline check env=trl`, docs/results.md).
"""

import json
import random


class GuessNumber:
    def __init__(self, high: int = 20):
        self.high = high
        self.secret, self.guesses, self.found = 0, [], False

    def reset(self, episode: int | None = None, **kwargs) -> str:
        # the row's `episode` seeds the secret: the completions of one GRPO group play the same game
        self.secret = random.Random(episode).randint(1, self.high)
        self.guesses, self.found = [], False
        return (f"I am thinking of a whole number from 1 to {self.high}. Find it with the guess tool: I answer "
                'higher, lower or correct. For example: <tool_call>{"name": "guess", "arguments": {"number": '
                f'{(self.high + 1) // 2}}}}}</tool_call>')

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: The whole number guessed.

        Returns:
            "higher" if the secret is above the guess, "lower" if below, "correct" if equal.
        """
        number = int(number)
        self.guesses.append(number)
        if number == self.secret:
            self.found = True
            return "correct"
        return "higher" if self.secret > number else "lower"

    def get_reward(self) -> float:
        """1.0 for finding the number (less 0.1 a guess after the first, at least 0.6); without it, up to 0.5 for
        the closest guess; 0 without a guess."""
        if self.found:
            return max(0.6, 1.0 - 0.1 * (len(self.guesses) - 1))
        if not self.guesses:
            return 0.0
        closest = min(abs(g - self.secret) for g in self.guesses)
        return 0.5 * max(0.0, 1.0 - closest / self.high)


def _call(number: int) -> str:
    return f"<tool_call>{json.dumps({'name': 'guess', 'arguments': {'number': number}})}</tool_call>"


def openings(num_episodes: int = 200) -> list[dict]:
    """The opening of each episode: a worked game, then the user message reset() completes; `episode` seeds it."""
    worked = [{"role": "user", "content": "I am thinking of a whole number from 1 to 20. Find it with the guess tool."},
              {"role": "assistant", "content": _call(10)}, {"role": "tool", "content": "higher"},
              {"role": "assistant", "content": _call(15)}, {"role": "tool", "content": "lower"},
              {"role": "assistant", "content": _call(12)}, {"role": "tool", "content": "correct"},
              {"role": "assistant", "content": "Found it: 12."}]
    return [{"prompt": [*worked, {"role": "user", "content": ""}], "episode": i} for i in range(num_episodes)]
