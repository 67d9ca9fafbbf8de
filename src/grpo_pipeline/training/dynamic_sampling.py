"""Dynamic sampling as functions of a step's rewards and TRL's batch tensors: no trainer, no TRL state.

With generation.oversample > 1 a step samples more groups than it trains. `PipelineTrainer` (training/trainer.py)
reads the step's reward totals from TRL's logs and asks these functions which rows to train:
- `spread_of_groups`: which groups' rewards differ (GRPO's only signal; a flat group has advantage 0 everywhere);
- `flat_groups_to_resample` / `rescue_groups`: adaptive sampling for flat groups (Reinforce-Ada, Xiong et al.
  2025, arXiv:2510.04996): more completions of a flat group's prompt, and the group trains on a balanced set of
  all its samples when they now differ;
- `negative_flat_groups`: negative sample reinforcement (Zhu et al. 2025, arXiv:2506.01347) for free slots;
- `keep_groups`: the rows trained (in sampling order, up to the step's batch), and their advantages.
"""

from dataclasses import dataclass

import torch

FLAT = 1e-3  # |advantage| below this everywhere in a group: the group is flat (when no rewards are at hand)
REWARD_TIE = 1e-6  # rewards of a group within this of each other: the group is flat

Totals = list[float | None]  # per completion: the weighted reward total, None where nothing scored it


def reward_totals(rewards: dict[str, list[float]], weights: list[float]) -> Totals:
    """Per completion, the weighted sum of its reward functions' scores as TRL sums them (a function that returned
    None, NaN here, did not score it); None where no function scored it (TRL gives it advantage 0)."""
    return [None if all(r != r for r in parts) else sum(w * r for w, r in zip(weights, parts, strict=True) if r == r)
            for parts in zip(*rewards.values(), strict=True)]


def has_spread(totals: Totals) -> bool:
    """A group's rewards differ: at least two scored, further apart than REWARD_TIE."""
    scored = [t for t in totals if t is not None]
    return len(scored) > 1 and max(scored) - min(scored) > REWARD_TIE


def spread_of_groups(totals: Totals | None, advantages: torch.Tensor, size: int) -> list[bool]:
    """Per group of `size` completions: do its rewards differ? Read from the reward totals (TRL's weighted total, as
    in its frac_reward_zero_std), not the advantages, which a float mean over a tiny std can push off 0; from the
    advantages (|a| > FLAT somewhere) only where no totals are at hand."""
    groups = advantages.size(0) // size
    if totals is None:
        return (advantages.view(groups, size).abs() > FLAT).any(dim=1).tolist()
    return [has_spread(totals[g * size:(g + 1) * size]) for g in range(groups)]


def union_advantages(totals: Totals, scale_rewards: str, batch_std: float) -> list[float]:
    """TRL's advantages (sum_then_normalize) for one group of any size: reward minus the group mean, divided by the
    group's std + 1e-4 (scale_rewards=group; batch: `batch_std`; none: not divided); unscored completions get 0."""
    values = torch.tensor([float("nan") if t is None else t for t in totals], dtype=torch.float64)
    scored = values[~values.isnan()]
    advantages = values - scored.mean()
    if scale_rewards != "none":
        advantages = advantages / ((scored.std().item() if scale_rewards == "group" else batch_std) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0).float().tolist()


def balanced(advantages: list[float], size: int) -> list[int]:
    """`size` indices of a group with spread: up to half above average (advantage > 0), the rest below, topped up
    from whichever side has more; earlier samples first on each side."""
    above = [i for i, a in enumerate(advantages) if a > 0]
    below = [i for i, a in enumerate(advantages) if a <= 0]
    take = min(len(above), max(1, size // 2))
    keep = above[:take] + below[:size - take]
    keep += above[take:take + size - len(keep)]
    return sorted(keep)


def flat_groups_to_resample(totals: Totals, spread: list[bool], size: int, need: int, limit: int) -> list[int]:
    """Up to min(need, limit) flat groups, in sampling order, with a completion that scored below the batch's best:
    the ones more samples may rescue (a flat group at the best has nothing to learn)."""
    scored = [t for t in totals if t is not None]
    if need <= 0 or not scored:
        return []
    best = max(scored)
    chosen = [g for g in range(len(spread)) if not spread[g]
              and any(t is not None and t < best - REWARD_TIE for t in totals[g * size:(g + 1) * size])]
    return chosen[:min(need, limit)]


def rescue_groups(totals: Totals, more: Totals, chosen: list[int], size: int, extra: int,
                  advantages: torch.Tensor, scale_rewards: str) -> tuple[list[int], torch.Tensor, list[int]]:
    """The resampled groups that now differ, trained on a balanced `size` of all their samples.

    `totals`: the first round's (groups x size); `more`: the extra round's, `extra` for each chosen group in order;
    `advantages`: both rounds' rows, the first round's first. Returns (for each first-round row, the row of both
    rounds it is replaced by; the advantages of both rounds, rescued groups' recomputed over all their samples;
    the groups rescued)."""
    n = len(totals)
    rows, advantages = list(range(n)), advantages.clone()
    everything = [t for t in totals + more if t is not None]
    batch_std = torch.tensor(everything, dtype=torch.float64).std().item() if len(everything) > 1 else 0.0
    rescued = []
    for c, g in enumerate(chosen):
        index = [g * size + i for i in range(size)] + [n + c * extra + j for j in range(extra)]
        union = [totals[i] if i < n else more[i - n] for i in index]
        if not has_spread(union):
            continue
        values = union_advantages(union, scale_rewards, batch_std)
        for slot, k in enumerate(balanced(values, size)):
            rows[g * size + slot] = index[k]
        advantages[index] = torch.tensor(values, dtype=advantages.dtype, device=advantages.device)
        rescued.append(g)
    return rows, advantages, rescued


def negative_flat_groups(totals: Totals | None, spread: list[bool], size: int, free: int, weight: float,
                         scale_rewards: str) -> dict[int, list[float]]:
    """Negative sample reinforcement for flat groups: a group whose completions all scored the same has no GRPO
    signal, however wrong they are; when the policy is sure of a wrong answer, every sample repeats it. Up to `free`
    such groups, in sampling order, that scored below the mean of the step's rewards get the advantage
    weight x (reward - mean) / std over the step's rewards (not divided with scale_rewards=none): the answer they
    agree on is pushed down. Unscored completions get 0. Returns {group: per-completion advantages}; empty where
    the step's rewards cannot be read."""
    scored = [t for t in totals or [] if t is not None]
    if len(scored) < 2 or free <= 0:
        return {}
    step = torch.tensor(scored, dtype=torch.float64)
    mean, std = step.mean().item(), step.std().item()
    chosen = {}
    for g in range(len(spread)):
        group = totals[g * size:(g + 1) * size]
        score = next((t for t in group if t is not None), None)
        if len(chosen) == free:
            break
        if spread[g] or score is None or score >= mean - REWARD_TIE:
            continue
        advantage = (score - mean) / ((std + 1e-4) if scale_rewards != "none" else 1.0)
        chosen[g] = [0.0 if t is None else weight * advantage for t in group]
    return chosen


@dataclass(frozen=True)
class Kept:
    rows: torch.Tensor  # the batch's rows trained, in sampling order
    advantages: torch.Tensor  # theirs (negative groups': set; all 0 where no group was kept)
    trained: int  # groups with spread kept
    negative: int  # flat groups kept with a negative advantage


def keep_groups(advantages: torch.Tensor, spread: list[bool], size: int, cap: int,
                negative: dict[int, list[float]] | None = None) -> Kept:
    """Of the groups sampled, up to `cap` whose rewards differ (in sampling order), and the `negative` flat groups
    with their advantages; if nothing is kept, one flat group with its advantages set to 0 (it trains nothing)."""
    kept = [g for g in range(len(spread)) if spread[g]][:cap]
    negative = negative or {}
    if negative:
        advantages = advantages.clone()
        for g, values in negative.items():
            advantages[g * size:(g + 1) * size] = torch.tensor(values, dtype=advantages.dtype)
    chosen = sorted(kept + list(negative))
    rows = torch.tensor([g * size + i for g in chosen or [0] for i in range(size)], device=advantages.device)
    selected = advantages.index_select(0, rows)
    return Kept(rows, selected if chosen else torch.zeros_like(selected), len(kept), len(negative))


def select_rows(out: dict, rows: torch.Tensor) -> dict:
    """The given rows of every per-row tensor of a TRL batch; other values as they are."""
    n = out["advantages"].size(0)
    return {k: v.index_select(0, rows) if torch.is_tensor(v) and v.dim() > 0 and v.size(0) == n else v
            for k, v in out.items()}


def concat_outputs(a: dict, b: dict, pad_id: int) -> dict:
    """Two outputs of TRL's _generate_and_score_completions as one batch: per-row tensors padded to a common width
    (prompts on the left, as TRL pads them; completion-aligned tensors on the right) and stacked; other values
    are a's."""
    n, m = a["advantages"].size(0), b["advantages"].size(0)
    out = dict(a)
    for key, x in a.items():
        y = b.get(key)
        if not (torch.is_tensor(x) and torch.is_tensor(y) and x.dim() > 0 and x.size(0) == n and y.size(0) == m):
            continue
        if x.dim() > 1 and x.size(1) != y.size(1):
            width = max(x.size(1), y.size(1))
            value = pad_id if key.endswith("_ids") else 1.0 if key == "importance_sampling_ratio" else 0
            left = key.startswith("prompt")
            x, y = (torch.nn.functional.pad(t, (width - t.size(1), 0) if left else (0, width - t.size(1)),
                                            value=value) for t in (x, y))
        out[key] = torch.cat([x, y])
    return out


def loss_mask(batch: dict) -> torch.Tensor:
    """The tokens a TRL batch trains on: the completion's, less the env's (tool_mask) in multi-turn episodes."""
    return batch["completion_mask"] if "tool_mask" not in batch else batch["completion_mask"] * batch["tool_mask"]
