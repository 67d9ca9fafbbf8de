"""Per-turn credit for multi-turn episodes (runtime.turn_credit=turn): each assistant turn gets its own advantage.

With episode credit (the default, GRPO's), every token of an episode shares one advantage: a good search followed by
a bad booking and a bad search followed by a lucky booking teach every turn the same thing. With turn credit an env
may score each assistant turn (`score_turn(messages, **row) -> float`, called after the turn), and turn k of
episode i gets

    A[i, k] = (G[i, k] - b[i, k]) / scale,   G[i, k] = sum of i's turn scores from turn k on + i's episode reward

the return from turn k on (rewards earned before turn k are not its doing), against a baseline b[i, k] that is the
mean of G[j, k] over the *other* episodes j of the group that reached turn k (leave-one-out; when none did, the
mean of the others' whole returns G[j, 1]; an episode with no other scored one in its group gets 0, as GRPO gives a
group of one). `scale` follows scale_rewards: the std of all the per-turn returns G of the group (group) or of the
batch (batch), + 1e-4, or 1 (none); zero spread there means every advantage is 0 anyway.

Why this estimator (verl #7244): the natural construction, normalising turn rewards per turn index and summing
what each episode's turns got, subtracts a baseline whose number of terms is set by the episode's own stopping
turn: an action-dependent baseline, biased whenever the policy controls the episode's length (a hidden bonus or
penalty for taking another turn). Here the baseline of turn k is built from other episodes only, so it cannot
depend on what episode i does at turn k or after, and E[grad log pi(a_k | s_k) * b] = 0: the estimator is unbiased
for the gradient of E[sum of turn scores + episode reward] (REINFORCE with reward-to-go). A test checks this
exactly, by enumeration, on an MDP where the policy decides whether to take another turn
(tests/test_turn_credit.py), and that the per-index normalisation is biased there. Exactly so with
scale_rewards=none and a loss normalised by a constant; dividing by a std that includes the episode's own returns
(scale_rewards=group, as GRPO does) and losses that divide a sequence by its own length (grpo, sapo, luspo) bring
back the small own-episode dependence they bring to episode credit. The price of leave-one-out: advantages are
n/(n-1) times GRPO's for equal-length episodes without turn scores.

An env without `score_turn` has every turn share the episode's reward (G[i, k] = R[i]); each turn is then still
compared with the other episodes that reached it. Functions of lists and tensors only; the trainer calls them.
"""

import statistics

import torch


def turn_returns(turn_scores: list[float], reward: float) -> list[float]:
    """G[k] for each turn k: the turn scores from k on, plus the episode's reward."""
    out, running = [], reward
    for score in reversed(turn_scores):
        running += score
        out.append(running)
    return out[::-1]


def group_turn_advantages(rewards: list[float | None], turn_scores: list[list[float]], scale: float
                          ) -> list[list[float]]:
    """Per episode of one group, per assistant turn, its advantage (module doc). An unscored episode (reward None)
    gets 0 on every turn and is no one's baseline. `turn_scores[i]` has one score per assistant turn of episode i
    (0.0 where the env has no score_turn)."""
    returns = [None if r is None else turn_returns(s, r) for r, s in zip(rewards, turn_scores, strict=True)]
    totals = [None if r is None else r + sum(s) for r, s in zip(rewards, turn_scores, strict=True)]
    out = []
    for i, mine in enumerate(returns):
        others = [g for j, g in enumerate(returns) if j != i and g is not None]
        if mine is None or not others:  # unscored, or no other episode to compare with
            out.append([0.0] * len(turn_scores[i]))
            continue
        whole = statistics.fmean(t for j, t in enumerate(totals) if j != i and t is not None)
        advantages = []
        for k, g in enumerate(mine):
            reached = [o[k] for o in others if len(o) > k]
            baseline = statistics.fmean(reached) if reached else whole
            advantages.append((g - baseline) / scale)
        out.append(advantages)
    return out


def turn_segments(model_mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of 1s: the assistant turns of a completion whose env tokens are 0."""
    segments, start = [], None
    for i, m in enumerate([*model_mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            segments.append((start, i))
            start = None
    return segments


def per_token_advantages(totals: list[float | None], turn_scores: list[list[float] | None], tool_mask: torch.Tensor,
                         size: int, scale_rewards: str) -> torch.Tensor:
    """[rows, completion tokens] advantages of a TRL batch of multi-turn episodes in groups of `size` (sampling
    order): each assistant turn's tokens (the runs of 1s of `tool_mask`) carry that turn's advantage; env tokens 0.
    `totals`: each episode's reward total (None: unscored); `turn_scores`: its score_turn values (None or shorter:
    0.0 for the turns without one)."""
    rows = tool_mask.size(0)
    segments = [turn_segments(tool_mask[r].tolist()) for r in range(rows)]
    # the episode's turns: one score per assistant turn from the rollout (a row whose tokens TRL masked, e.g. a
    # truncated one, keeps them: it still counts in the others' baselines); else one per run of model tokens
    scores = [list(s) if s is not None else [0.0] * len(seg) for s, seg in zip(turn_scores, segments, strict=True)]
    returns = [[] if t is None else turn_returns(s, t) for t, s in zip(totals, scores, strict=True)]
    pooled = [g for r in returns for g in r]
    batch_std = statistics.stdev(pooled) if len(pooled) > 1 else 0.0
    out = torch.zeros(tool_mask.shape, dtype=torch.float32, device=tool_mask.device)
    for g in range(rows // size):
        members = range(g * size, (g + 1) * size)
        if scale_rewards == "none":
            scale = 1.0
        else:
            group = [v for i in members for v in returns[i]]
            scale = ((statistics.stdev(group) if len(group) > 1 else 0.0) if scale_rewards == "group"
                     else batch_std) + 1e-4
        advantages = group_turn_advantages([totals[i] for i in members], [scores[i] for i in members], scale)
        for i, values in zip(members, advantages, strict=True):
            for (start, end), value in zip(segments[i], values, strict=False):  # a masked row: fewer runs
                out[i, start:end] = value
    return out
