"""Per-turn credit (runtime.turn_credit=turn): the estimator is unbiased when the policy decides the episode's length
(exactly, by enumeration), the credit lands on the turn that earned it, and a real training step trains with it."""

import itertools
import math

import pytest
import torch
from datasets import Dataset

import grpo_pipeline.recipe as recipe
from conftest import tiny_overrides
from grpo_pipeline.errors import ConfigError
from grpo_pipeline.training.turn_credit import (
    group_turn_advantages,
    per_token_advantages,
    turn_returns,
    turn_segments,
)

# A two-turn MDP where the policy controls the episode's length. Turn 1: "go" (probability p) earns a turn score of
# 0.2 and leads to turn 2, or "stop" ends the episode with reward 0.6. Turn 2: "x" (probability q) ends with reward 1,
# "y" with 0. Outcome -> (turn scores, episode reward, d log pi / d theta1 per turn, d log pi / d theta2 per turn).
P, Q = 0.3, 0.6  # sigmoid(theta1), sigmoid(theta2)
OUTCOMES = {
    "stop": (1 - P, [0.0], 0.6, [-P], [0.0]),
    "go-x": (P * Q, [0.2, 0.0], 1.0, [1 - P, 0.0], [0.0, 1 - Q]),
    "go-y": (P * (1 - Q), [0.2, 0.0], 0.0, [1 - P, 0.0], [0.0, -Q]),
}
TRUE_GRADIENT = (P * (1 - P) * (0.2 + Q - 0.6), P * Q * (1 - Q))  # of J = (1-p) 0.6 + p (0.2 + q)


def _expected_gradient(advantages_of) -> tuple[float, float]:
    """E[sum over episode 0's turns of grad log pi(a_k) * A[0, k]] over every outcome of a group of 3, exactly."""
    g1 = g2 = 0.0
    for group in itertools.product(OUTCOMES, repeat=3):
        prob = math.prod(OUTCOMES[o][0] for o in group)
        advantages = advantages_of([OUTCOMES[o][2] for o in group], [OUTCOMES[o][1] for o in group])[0]
        _, _, _, d1, d2 = OUTCOMES[group[0]]
        g1 += prob * sum(a * d for a, d in zip(advantages, d1, strict=True))
        g2 += prob * sum(a * d for a, d in zip(advantages, d2, strict=True))
    return g1, g2


def _per_index_normalised(rewards, turn_scores):
    """The natural construction (MT-GRPO-style): each turn's reward (the last turn's includes the episode's) minus
    the mean over the episodes that reached that turn index, summed from turn k to the episode's own end."""
    per_turn = [s[:-1] + [s[-1] + r] for s, r in zip(turn_scores, rewards, strict=True)]
    means = {k: sum(p[k] for p in per_turn if len(p) > k) / max(1, sum(len(p) > k for p in per_turn))
             for k in range(2)}
    centred = [[v - means[k] for k, v in enumerate(p)] for p in per_turn]
    return [[sum(c[k:]) for k in range(len(c))] for c in centred]


def test_turn_credit_is_unbiased_when_the_policy_controls_the_episodes_length():
    ours = _expected_gradient(lambda r, s: group_turn_advantages(r, s, scale=1.0))
    assert ours == pytest.approx(TRUE_GRADIENT, abs=1e-12)
    natural = _expected_gradient(_per_index_normalised)
    assert abs(natural[0] - TRUE_GRADIENT[0]) > 0.01  # the per-index baseline biases the "take another turn" choice


def test_the_credit_lands_on_the_turn_that_earned_it():
    # two episodes of one group with the same final reward: A searched well (turn 1 scored 0.5) and then booked
    # badly, B searched badly and booked just as badly. Only A's first turn earned anything
    rewards, scores = [0.2, 0.2], [[0.5, 0.0], [0.0, 0.0]]
    a, b = group_turn_advantages(rewards, scores, scale=1.0)
    assert a[0] == pytest.approx(0.5) and b[0] == pytest.approx(-0.5)  # the search that earned it, and the one that did not
    assert a[1] == pytest.approx(0.0) and b[1] == pytest.approx(0.0)  # the bookings were alike: no credit either way
    assert turn_returns([0.5, 0.0], 0.2) == pytest.approx([0.7, 0.2])
    # episode credit would have given A's booking +0.25 for a search it did not make; an unscored episode gets 0
    assert group_turn_advantages([None, 1.0], [[0.3], [0.0]], scale=1.0)[0] == [0.0]


def test_per_token_advantages_follow_the_turns_of_each_row():
    assert turn_segments([1, 1, 0, 0, 1, 0, 1]) == [(0, 2), (4, 5), (6, 7)]
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 0, 1, 1, 1]])
    out = per_token_advantages([0.2, 0.2], [[0.5, 0.0], None], mask, size=2, scale_rewards="none")
    assert torch.allclose(out, torch.tensor([[0.5, 0.5, 0.0, 0.0, 0.0], [-0.5, 0.0, 0.0, 0.0, 0.0]]))


class ScoredTurnsEnv:
    """Answers every turn with a tool result until the third; scores each turn by its length."""

    max_turns = 3
    turn_max_new_tokens = 6

    def build_dataset(self, tokenizer):
        system = {"role": "system", "content": "You are a counting assistant. " * 4}
        return Dataset.from_list([{"prompt": [system, {"role": "user", "content": f"Count to {i}"}], "i": i}
                                  for i in range(24)])

    def respond(self, messages, i):
        return {"role": "tool", "content": f"result for {i}"}

    def score_turn(self, messages, i):
        assert messages[-1]["role"] == "assistant"
        return (len(messages[-1]["content"]) % 3) / 10

    def score_episode(self, model, tokenizer, completion, i):
        return (sum(len(m["content"]) for m in completion if m["role"] == "assistant") % 5) / 4


def test_a_training_step_trains_each_turn_with_its_own_advantage(compose_cfg, tmp_path, monkeypatch):
    from grpo_pipeline.training.trainer import PipelineTrainer

    seen = []
    original = PipelineTrainer._generate_and_score_completions

    def capture(self, inputs):
        out = original(self, inputs)
        seen.append((out, [dict(x) for x in inputs]))
        return out

    monkeypatch.setattr(PipelineTrainer, "_generate_and_score_completions", capture)
    cfg = compose_cfg([*tiny_overrides(tmp_path, ["env=custom", "env._target_=unused.Env"]), "loss=grpo",
                       "runtime.turn_credit=turn", "loss.scale_rewards=none"])
    result = recipe.train(cfg, launch_dir=str(tmp_path), env=ScoredTurnsEnv())
    assert result.steps == 2
    out, rows = seen[0]
    advantages, mask = out["advantages"], out["tool_mask"]
    assert advantages.shape == mask.shape  # one advantage per token
    assert (advantages * (1 - mask)).abs().sum() == 0  # the env's tokens carry none
    rewards = [r.get("turn_scores") for r in rows]
    assert all(len(s) == 3 for s in rewards)  # score_turn after each of the 3 assistant turns
    # the first group's turns: recomputed from its rewards as the module's doc says
    episode = [ScoredTurnsEnv().score_episode(None, None, r["transcript"], r["i"]) for r in rows[:2]]
    expected = group_turn_advantages(episode, rewards[:2], scale=1.0)
    for row in range(2):
        got = [advantages[row, s].item() for s, _ in turn_segments(mask[row].tolist())]
        assert got == pytest.approx(expected[row], abs=1e-5)


def test_turn_credit_is_refused_where_it_cannot_apply(compose_cfg, tmp_path):
    cfg = compose_cfg([*tiny_overrides(tmp_path), "runtime.turn_credit=turn"])  # arithmetic: single-turn
    with pytest.raises(ConfigError, match="runtime.turn_credit=turn"):
        recipe.train(cfg, launch_dir=str(tmp_path))
    cfg = compose_cfg([*tiny_overrides(tmp_path, ["env=custom", "env._target_=unused.Env"]),
                       "runtime.turn_credit=turn", "generation.oversample=2", "generation.flat_negative=0.5"])
    with pytest.raises(ConfigError, match="generation.flat_negative"):
        recipe.train(cfg, launch_dir=str(tmp_path), env=ScoredTurnsEnv())
