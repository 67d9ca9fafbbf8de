"""Step-wise rows: the turns a seed-style env sampled inside `score_episode`, as training rows of TRL's batch.

A recorded sample (envs/recorder.py) whose context is token-exactly its episode's row so far (the opening, the first
reply, what earlier samples appended) plus the env's tokens is chained onto that row (`chained`): the env's tokens
masked, the sampled ones trained, as the `respond` path lays out an episode; the shared context is computed once.
That is the usual case for an env that renders its conversation with the chat template. Any other sample becomes
one row of its own (`turn_rows`): the context the model saw is its prompt (no loss), the
tokens it sampled its completion, their log-probs the sampler's, and the advantage is its episode's (episode
credit: every turn of an episode shares the episode's score, as the first reply does). A row is added for every
episode row TRL trains; a dynamic-sampling step adds the turns of the episodes it kept, with the advantages they
were trained on. SkyRL's "step-wise training" is the same design: one row per assistant turn, its own prompt.
Functions of tensors and lists only; the trainer (trainer.py) computes the log-probs TRL needs for the new rows
(old / reference) with the model, as TRL computes them for the others.
"""

import torch

from grpo_pipeline.envs.recorder import TurnSample


def turn_rows(samples: list[list[TurnSample]], advantages: torch.Tensor, pad_id: int,
              mask_truncated: bool = False) -> dict | None:
    """The rows of the recorded samples of each episode row (`samples[i]` for the row whose advantage is
    `advantages[i]`), laid out as TRL lays out a batch: prompts left-padded, completions right-padded, masks, the
    advantages, and `sampling_per_token_logps`. None when no episode sampled anything. `mask_truncated`: a sample
    cut by max_new_tokens carries no loss (TRL's mask_truncated_completions)."""
    rows = [(s, a) for episode, a in zip(samples, advantages.tolist(), strict=True) for s in episode]
    if not rows:
        return None
    device = advantages.device
    p_width = max(len(s.prompt_ids) for s, _ in rows)
    c_width = max(len(s.completion_ids) for s, _ in rows)
    prompt_ids = torch.full((len(rows), p_width), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((len(rows), p_width), dtype=torch.long)
    completion_ids = torch.full((len(rows), c_width), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((len(rows), c_width), dtype=torch.long)
    logps = torch.zeros((len(rows), c_width), dtype=torch.float32)
    for i, (s, _) in enumerate(rows):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        prompt_ids[i, p_width - p:] = torch.tensor(s.prompt_ids)
        prompt_mask[i, p_width - p:] = 1
        completion_ids[i, :c] = torch.tensor(s.completion_ids)
        completion_mask[i, :c] = 0 if mask_truncated and not s.ended else 1
        logps[i, :c] = torch.tensor(s.logprobs)
    return {"prompt_ids": prompt_ids.to(device), "prompt_mask": prompt_mask.to(device),
            "completion_ids": completion_ids.to(device), "completion_mask": completion_mask.to(device),
            "advantages": torch.tensor([a for _, a in rows], dtype=advantages.dtype, device=device),
            "sampling_per_token_logps": logps.to(device)}



def chained(out: dict, samples: list[list[TurnSample]], pad_id: int, mask_truncated: bool = False
            ) -> tuple[dict, list[list[TurnSample]], list[int]]:
    """TRL's batch `out` with each row's recorded samples that continue it token-exactly appended to its completion
    (the env's tokens between them: completion_mask 1, tool_mask 0, sampling log-prob 0), in call order, as long as
    they chain. Returns (the batch, the samples left for rows of their own, the rows that grew). Only the layout: the
    caller computes old / reference log-probs of the rows that grew. A row whose completion is masked whole (a
    truncated one under mask_truncated) stays untrained: its tokens are laid out (attended, tool_mask 0) where its
    samples chain onto it."""
    rows = out["completion_ids"].size(0)
    ratio = out.get("importance_sampling_ratio")
    if ratio is not None and ratio.dim() == 2 and ratio.size(1) == 1:
        # a sequence-level ratio (vLLM's sequence mask) covers the first reply only: it must not weigh the env's turns
        return out, [list(s) for s in samples], []
    lengths = out["completion_mask"].sum(dim=1).tolist()
    heads = [0] * rows  # rows masked whole whose samples chain: how many of their reply's tokens are laid out, untrained
    tails, rest = [], []
    for r in range(rows):
        ids, model, logps, left = [], [], [], list(samples[r])
        prompt = out["prompt_ids"][r][out["prompt_mask"][r].bool()].tolist()
        if not lengths[r] and left and left[0].prompt_ids[: len(prompt)] == prompt:
            # a reply TRL masked whole (truncated, under mask_truncated): it stays untrained, but the turns the env
            # sampled after it chain onto it; its tokens are those the sample's context and the row share
            reply, seen = out["completion_ids"][r].tolist(), left[0].prompt_ids[len(prompt):]
            heads[r] = lengths[r] = next((k for k, (a, b) in enumerate(zip(reply, seen, strict=False)) if a != b),
                                         min(len(reply), len(seen)))
        if lengths[r]:
            context = prompt + out["completion_ids"][r, : lengths[r]].tolist()
            while left and len(left[0].prompt_ids) >= len(context) and left[0].prompt_ids[: len(context)] == context:
                s = left.pop(0)
                between = s.prompt_ids[len(context):]
                trained = 0 if mask_truncated and not s.ended else 1
                ids += between + s.completion_ids
                model += [0] * len(between) + [trained] * len(s.completion_ids)
                logps += [0.0] * len(between) + list(s.logprobs)
                context = s.prompt_ids + s.completion_ids
        tails.append((ids, model, logps))
        rest.append(left)
    grown = [r for r in range(rows) if tails[r][0]]
    if not grown:
        return out, rest, []
    width = max(lengths[r] + len(tails[r][0]) for r in range(rows))
    width = max(width, out["completion_ids"].size(1))
    device = out["completion_ids"].device

    def widened(key: str, fill) -> torch.Tensor:
        old = out[key]
        new = torch.full((rows, width), fill, dtype=old.dtype, device=device)
        new[:, : old.size(1)] = old
        return new

    known = {"completion_ids", "completion_mask", "tool_mask", "sampling_per_token_logps", "old_per_token_logps",
             "ref_per_token_logps", "importance_sampling_ratio", "turn_advantages", "prompt_ids", "prompt_mask"}
    unknown = [k for k, v in out.items() if torch.is_tensor(v) and v.dim() >= 2 and k not in known]
    if unknown:
        raise NotImplementedError(f"chaining an env's own generate calls onto its episode's row with {unknown} in "
                                  "TRL's batch is not supported; set runtime.train_env_calls=false")
    new = dict(out)
    new["completion_ids"] = widened("completion_ids", pad_id)
    new["completion_mask"] = widened("completion_mask", 0)
    new["tool_mask"] = widened("tool_mask", 1) if "tool_mask" in out else torch.ones_like(new["completion_mask"])
    logp_keys = [k for k in ("sampling_per_token_logps", "old_per_token_logps", "ref_per_token_logps") if k in out]
    for key in logp_keys:
        new[key] = widened(key, 0.0)
    if "turn_advantages" in out:  # per-turn credit: a turn the env sampled itself gets its episode's advantage
        new["turn_advantages"] = widened("turn_advantages", 0.0)
    if ratio is not None and ratio.dim() == 2:
        new["importance_sampling_ratio"] = widened("importance_sampling_ratio", 1.0)
    for r in grown:
        ids, model, logps = tails[r]
        new["completion_mask"][r, : heads[r]] = 1  # attended, not trained
        new["tool_mask"][r, : heads[r]] = 0
        span = slice(lengths[r], lengths[r] + len(ids))
        new["completion_ids"][r, span] = torch.tensor(ids, device=device)
        new["completion_mask"][r, span] = 1
        new["tool_mask"][r, span] = torch.tensor(model, dtype=new["tool_mask"].dtype, device=device)
        if "sampling_per_token_logps" in new:
            new["sampling_per_token_logps"][r, span] = torch.tensor(logps, device=device)
        if "turn_advantages" in new:
            new["turn_advantages"][r, span] = out["advantages"][r]
    return new, rest, grown
