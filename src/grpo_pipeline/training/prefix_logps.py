"""Per-token log-probs for the loss with the batch's shared prompt prefix computed once.

TRL's loss forward runs every sequence of a batch from its first token: prompt + completion. The prompts of
a GRPO batch share most of their tokens (the chat template's system prompt, a worked example, the tool
descriptions), and a group's completions share the whole prompt. Here the longest token prefix that every
sequence starts with goes through the model once, with gradients; its keys and values are repeated for
each sequence, and only the rest (each prompt's own tail + its completion) is run per sequence:

    [shared prefix]  ->  KV cache (once)          rows: [tail, left-padded | completion, right-padded]

Attention is masked by hand (a 4D mask: causal over absolute positions, padding holes off) and positions
come from the real tokens, so every token sees exactly what it sees in TRL's layout: the log-probs match
TRL's to float tolerance and gradients flow into the prefix through every row (autograd sums them).
A test checks both. On SmolLM2 + `env=arithmetic` (~95 of ~106 prompt tokens shared) the loss
forward+backward gets ~3x cheaper; multi-turn envs with long system prompts gain more.

Used only where it is exact and simple: one process, text-only inputs, a rotary-position decoder on sdpa
attention without sliding windows or dropout (`supported`), and a prefix of at least `MIN_PREFIX` tokens;
otherwise TRL's own path runs. (The hand-built boolean mask means "may attend" to sdpa only: eager attention
would add it; a sliding window or absolute positions over left padding would differ from TRL's layout.)
"""

import copy

import torch

from grpo_pipeline.rollout.decode import CACHE_KWARG

MIN_PREFIX = 16


def supported(model) -> bool:
    """The model computes here exactly what it computes in TRL's layout (see the module docstring)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if not (getattr(config, "rope_parameters", None) or getattr(config, "rope_theta", None)):
        return False  # absolute positions: TRL's path counts the left padding, this one does not
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return False
    if any("sliding" in str(kind) for kind in (getattr(config, "layer_types", None) or [])):
        return False
    if getattr(config, "attention_dropout", 0.0) or getattr(config, "hidden_dropout", 0.0):
        return False
    return not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())  # e.g. lora.dropout


def shared_prefix_length(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int) -> int:
    """Tokens every row's prompt starts with (after its left padding), leaving each row one prompt token."""
    rows = [ids[:prompt_width][mask[:prompt_width].bool()].tolist() for ids, mask in zip(input_ids, attention_mask,
                                                                                           strict=True)]
    first, n = rows[0], min(len(r) for r in rows) - 1
    for i in range(max(n, 0)):
        if any(r[i] != first[i] for r in rows[1:]):
            return i
    return max(n, 0)


def per_token_logps(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                    prefix_length: int, compute_entropy: bool, batch_size: int, autocast):
    """(log-probs, entropies or None) of the last `logits_to_keep` tokens, as TRL's
    `_get_per_token_logps_and_entropies` returns them, with the first `prefix_length` prompt tokens shared.
    `model` must carry TRL's fused LM head (`fused_lm_head=True`).

    Rows run in groups of similar length (`length_groups`), each padded only to its own longest tail and
    completion: TRL pads every row to the batch's longest completion, which for multi-turn episodes (one turn
    here, three there) is about half padding. A row's completion ends at its last attended token; what follows is
    padding, which no earlier token sees and the loss masks out, so its log-probs and entropies are returned as 0."""
    prompt_width = input_ids.size(1) - logits_to_keep
    device = input_ids.device
    n = prefix_length
    prompts = [ids[:prompt_width][mask[:prompt_width].bool()] for ids, mask in zip(input_ids, attention_mask,
                                                                                    strict=True)]
    prefix, tails = prompts[0][:n], [p[n:] for p in prompts]
    attended = attention_mask[:, prompt_width:].bool()
    positions_kept = torch.arange(1, logits_to_keep + 1, device=device)
    ends = (attended * positions_kept).amax(dim=1).tolist() if logits_to_keep else [0] * len(tails)

    with autocast():
        out = model(input_ids=prefix[None], use_cache=True, logits_to_keep=1)
    cache = _cache_of(out)
    order, logps, entropies = [], [], []
    for rows in length_groups([len(t) for t in tails], ends, batch_size):
        width = max(len(tails[i]) for i in rows)
        kept = max(1, max(ends[i] for i in rows))  # at least one token: the loss keeps a graph even when all are masked
        rest = torch.zeros((len(rows), width + kept), dtype=input_ids.dtype, device=device)
        rest_mask = torch.zeros_like(rest)
        for j, i in enumerate(rows):
            rest[j, width - len(tails[i]):width] = tails[i]
            rest_mask[j, width - len(tails[i]):width] = 1
            rest[j, width:] = input_ids[i, prompt_width:prompt_width + kept]
            rest_mask[j, width:] = attention_mask[i, prompt_width:prompt_width + kept]
        full_mask = torch.cat([torch.ones((len(rows), n), dtype=rest_mask.dtype, device=device), rest_mask], dim=1)
        positions = (full_mask.cumsum(1) - 1).clamp(min=0)[:, n:]
        labels = rest.masked_fill(rest_mask == 0, -100)
        labels[:, :width] = -100  # only completion tokens are scored, as in TRL
        chunk_cache = copy.copy(cache)  # the prefix's tensors, repeated per row (differentiable)
        chunk_cache.layers = [copy.copy(layer) for layer in cache.layers]
        chunk_cache.batch_repeat_interleave(len(rows))
        with autocast():
            out = model(input_ids=rest, attention_mask=_attention_mask(full_mask, n), position_ids=positions,
                        labels=labels, fused_lm_head=True, **{CACHE_KWARG: chunk_cache})
        pad = (0, logits_to_keep - kept)
        logps.append(torch.nn.functional.pad(out.log_probs[:, -kept:], pad))
        if compute_entropy:
            entropies.append(torch.nn.functional.pad(out.entropy[:, -kept:], pad))
        order += rows
    back = torch.tensor(order, device=device).argsort()  # the groups' rows back in the batch's order
    return (torch.cat(logps).index_select(0, back),
            torch.cat(entropies).index_select(0, back) if compute_entropy else None)


def length_groups(tails: list[int], completions: list[int], most: int, slack: float = 1.25) -> list[list[int]]:
    """Row indices in groups of at most `most` rows, by length: a group grows while its padded size (rows x
    (longest tail + longest completion)) stays within `slack` x its rows' own tokens. Each group is one forward
    pass, which reads every weight once, so a little padding is cheaper than another pass."""
    groups: list[list[int]] = []
    for i in sorted(range(len(tails)), key=lambda i: (tails[i] + completions[i], i)):
        group = groups[-1] if groups else None
        if group is not None and len(group) < most:
            rows = group + [i]
            padded = len(rows) * (max(tails[r] for r in rows) + max(completions[r] for r in rows))
            if padded <= slack * sum(tails[r] + completions[r] for r in rows):
                group.append(i)
                continue
        groups.append([i])
    return groups


def _cache_of(out):
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    if cache is None or not hasattr(cache, "layers"):
        raise TypeError("the model returned no layered KV cache for the shared prefix")
    return cache


def _attention_mask(full_mask: torch.Tensor, prefix_length: int) -> torch.Tensor:
    """A boolean (batch, 1, queries, keys) mask: query i (absolute position prefix + i) sees key j <= it,
    and no padding."""
    keys = full_mask.size(1)
    queries = keys - prefix_length
    causal = torch.arange(keys, device=full_mask.device)[None, :] <= (
        torch.arange(queries, device=full_mask.device)[:, None] + prefix_length)
    return (causal[None] & full_mask[:, None, :].bool())[:, None]
