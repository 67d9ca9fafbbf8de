"""Step-wise rows: the turns a seed-style env sampled inside `score_episode`, as training rows of TRL's batch.

Each recorded sample (envs/recorder.py) becomes one row: the context the model saw is its prompt (no loss), the
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

