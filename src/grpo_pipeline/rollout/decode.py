"""The runtime's decode loop: a batch of token sequences continued until each one ends.

Why not `model.generate`: this loop does what the rollout needs and generate does not, and that costs time on
a CPU. Measured on 2 cores, SmolLM2-135M, 32 rows (`scripts/bench/rollouts.py`):
- rows that reached eos leave the batch (their KV cache rows are dropped), so a batch whose completions end
  at ~20 tokens does not keep running 32 rows to the longest one;
- sampling by inverse CDF (one uniform draw per row) instead of `torch.multinomial`, whose exponential draw over
  the whole 49k vocabulary took ~45 ms a step at 32 rows (11% of a decode step);
- the sampled tokens' log-probs are taken at each step, instead of keeping every step's logits.
Sampling follows generate's warpers in generate's order: temperature, then top-k, then top-p (keeping at
least one token). Log-probs are those TRL computes: log-softmax of logits / temperature (before top-k/top-p).
Greedy decoding gives generate's tokens exactly (a test checks it, with and without a shared prefix).
"""

import copy
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.generation import utils as _generation_utils

# transformers renamed generate's and forward's `past_key_values` to `cache` (5.2x)
CACHE_KWARG = "cache" if hasattr(_generation_utils, "DEPRECATED_CACHE_NAMES") else "past_key_values"

COMPACT_SHARE = 0.25  # drop finished rows from the batch once this share of the live rows has finished


def decode(model, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, sampling: dict, eos_ids: list[int],
           cache=None, prefix_length: int = 0, with_logprobs: bool = True, snapshots: list | None = None
           ) -> tuple[list[list[int]], list[list[float]]]:
    """Continue every row of `ids` (left-padded; `mask` marks real tokens; the first `prefix_length` columns may
    already be in `cache`). Returns per row the new ids up to and including its first eos, and their log-probs.
    `snapshots` (a list of `batch` Nones): filled with each row's KV cache as it leaves the batch (`RowCache`), so
    that a next turn can continue from it instead of prefilling the row again."""
    batch = ids.size(0)
    width, real = ids.size(1), mask.sum(1).tolist()
    do_sample = bool(sampling.get("do_sample", False))
    temperature = float(sampling.get("temperature") or 1.0) if do_sample else 1.0
    top_k, top_p = int(sampling.get("top_k") or 0), float(sampling.get("top_p") or 1.0)
    device = ids.device
    eos = torch.tensor(eos_ids, dtype=torch.long, device=device)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    out_ids: list[list[int]] = [[] for _ in range(batch)]
    out_logps: list[list[float]] = [[] for _ in range(batch)]
    rows = torch.arange(batch, device=device)  # original row of each live row
    step_ids = ids[:, prefix_length:]
    step_pos = positions[:, prefix_length:]
    done = torch.zeros(batch, dtype=torch.bool, device=device)  # per live row: reached eos (tokens after it are cut at the end)
    finished = 0  # rows done since the last compaction
    for _ in range(max_new_tokens):
        kwargs = {CACHE_KWARG: cache} if cache is not None else {}
        out = model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, use_cache=True,
                    logits_to_keep=last_position(step_ids), **kwargs)
        cache = growing_cache(getattr(out, "cache", None) or out.past_key_values)
        logits = out.logits[:, -1, :].float()
        if do_sample:
            scaled = logits / temperature
            tokens = _sample(_warp(scaled, top_k, top_p))
        else:
            scaled, tokens = logits, logits.argmax(-1)
        if with_logprobs:
            logps = torch.log_softmax(scaled, -1).gather(-1, tokens[:, None]).squeeze(-1).tolist()
        for live, (row, token) in enumerate(zip(rows.tolist(), tokens.tolist(), strict=True)):
            out_ids[row].append(token)
            out_logps[row].append(logps[live] if with_logprobs else 0.0)
        newly_done = torch.isin(tokens, eos) & ~done
        done |= newly_done
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones((mask.size(0), 1), dtype=mask.dtype, device=device)], dim=1)
        step_ids, step_pos = tokens[:, None], step_pos[:, -1:] + 1
        finished += int(newly_done.sum())
        if finished >= COMPACT_SHARE * len(rows):  # rows past their eos leave the batch (and its KV cache)
            keep = (~done).nonzero().squeeze(-1)
            if snapshots is not None:
                _snapshot(snapshots, cache, mask, rows, done.nonzero().squeeze(-1), out_ids, width, real)
            cache.batch_select_indices(keep)
            rows, mask, step_ids, step_pos, done = rows[keep], mask[keep], step_ids[keep], step_pos[keep], done[keep]
            finished = 0
    if snapshots is not None:
        _snapshot(snapshots, cache, mask, rows, torch.arange(len(rows), device=device), out_ids, width, real)
    return _cut_at_eos(out_ids, out_logps, eos_ids)


@dataclass
class RowCache:
    """One sequence's KV cache after a decode: per layer (keys, values) of shape [heads, columns, head_dim], the
    mask over those columns (0 on padding holes and on tokens dropped), and how many tokens of the sequence it
    holds, in order. Generated tokens start at column `start`; `fed` of them are in the cache."""
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    mask: torch.Tensor
    tokens: int
    start: int = 0
    fed: int = 0

    def keep(self, generated: int) -> "RowCache":
        """The cache of the sequence that keeps only the first `generated` of the tokens this decode produced
        (the rest, sampled after an eos or past a row's own limit, are masked out)."""
        return self.truncated(self.tokens - self.fed + min(self.fed, generated))

    def drop_last(self) -> "RowCache":
        """The cache without its last token (so that a continuation has at least one token to feed)."""
        return self.truncated(self.tokens - 1)

    def truncated(self, tokens: int) -> "RowCache":
        """The cache of the sequence's first `tokens` tokens (the columns of the others masked out)."""
        if tokens >= self.tokens:  # (masks are never written in place: sharing one is safe)
            return RowCache(self.layers, self.mask, self.tokens)
        mask = self.mask.clone()
        mask[int(mask.nonzero()[tokens]) if tokens else 0:] = 0
        return RowCache(self.layers, mask, tokens)

    def compact(self) -> "RowCache":
        """The same cache without its masked columns (padding holes, tokens dropped): smaller, and as good, since
        positions come from the mask."""
        if bool(self.mask.all()):
            return RowCache(self.layers, self.mask, self.tokens)
        real = self.mask.nonzero().squeeze(-1)
        return RowCache([(k[:, real], v[:, real]) for k, v in self.layers], self.mask[real], self.tokens)

    def empty(self) -> "RowCache":
        """A cache of no tokens, shaped like this one (a row without a cache in a batch of rows with one)."""
        return RowCache([(k[:, :0], v[:, :0]) for k, v in self.layers], self.mask[:0], 0)


def cached_rows(caches: list[RowCache]) -> tuple[DynamicCache, torch.Tensor]:
    """One batch cache from row caches, each right-aligned to the longest (the columns in front masked), and its
    mask [rows, columns]."""
    width = max(c.mask.numel() for c in caches)
    mask = torch.zeros((len(caches), width), dtype=caches[0].mask.dtype, device=caches[0].mask.device)
    data = []
    for layer in range(len(caches[0].layers)):
        keys, values = caches[0].layers[layer]
        shape = (len(caches), keys.size(0), width, keys.size(-1))
        k, v = keys.new_zeros(shape), values.new_zeros(shape)
        for i, c in enumerate(caches):
            n = c.mask.numel()
            k[i, :, width - n:], v[i, :, width - n:] = c.layers[layer]
        data.append((k, v))
    for i, c in enumerate(caches):
        mask[i, width - c.mask.numel():] = c.mask
    return DynamicCache(ddp_cache_data=data), mask


def _snapshot(snapshots: list, cache, mask, rows, leaving: torch.Tensor, out_ids, width: int, real: list[int]):
    if not all(isinstance(layer, DynamicLayer) and not layer.is_sliding for layer in cache.layers):  # no holes allowed
        return
    length = cache.get_seq_length()
    kept = [(layer.keys[leaving], layer.values[leaving]) for layer in cache.layers]
    for j, live in enumerate(leaving.tolist()):
        row = int(rows[live])
        fed = len(out_ids[row]) - 1  # the last token sampled was never fed
        snapshots[row] = RowCache([(k[j], v[j]) for k, v in kept], mask[live, :length].clone(), real[row] + fed,
                                  start=width, fed=fed)


class GrowingLayer(DynamicLayer):
    """A DynamicLayer that writes new keys and values into spare room at the end of its tensors instead of
    concatenating: `torch.cat` copies the whole cache at every decode step (measured on SmolLM2, 8 rows with an
    800-token cache: 42% of a decode step). The room grows by half when full; the layer's `keys` and `values`
    stay views of the filled part, so everything that reads them works as before."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, n = self.get_seq_length(), key_states.shape[-2]
        room = getattr(self, "_room", None)
        # a fresh tensor (batch_select_indices, repeat_interleave, reset) or a full room: move into a new room
        if room is None or self.keys.data_ptr() != room[0].data_ptr() or length + n > room[0].shape[-2]:
            capacity = length + n + max(64, (length + n) // 2)
            room = tuple(t.new_empty((*t.shape[:-2], capacity, t.shape[-1])) for t in (key_states, value_states))
            if length:
                room[0][..., :length, :], room[1][..., :length, :] = self.keys, self.values
            self._room = room
        room[0][..., length:length + n, :], room[1][..., length:length + n, :] = key_states, value_states
        self.keys, self.values = room[0][..., :length + n, :], room[1][..., :length + n, :]
        return self.keys, self.values


def growing_cache(cache):
    """The cache with its plain DynamicLayers turned into GrowingLayers (in place; other layer kinds untouched)."""
    for layer in getattr(cache, "layers", ()):
        if type(layer) is DynamicLayer:
            layer.__class__ = GrowingLayer
    return cache


def last_position(ids: torch.Tensor) -> int | torch.Tensor:
    """`logits_to_keep` for the last position of `ids`. For more than one column, as an index tensor: HF models
    then gather the last hidden state into a contiguous tensor, where `logits_to_keep=1` hands the LM head a strided
    view that torch's matmul cannot fold into one mm for weights without requires_grad (the runtime's copies): it
    expanded the LM head's weight per row instead (32 rows x 49152 x 576 copied: seconds per rollout on SmolLM2)."""
    return 1 if ids.size(1) == 1 else torch.tensor([ids.size(1) - 1], device=ids.device)


def expand_cache(cache, batch: int):
    """A copy of a batch-1 KV cache repeated `batch` times (the original stays usable)."""
    cache = copy.deepcopy(cache)
    cache.batch_repeat_interleave(batch)
    return cache


def _warp(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove = cumulative <= (1 - top_p)
        remove[:, -1] = False  # keep at least one token
        logits = logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    return logits


def _sample(logits: torch.Tensor) -> torch.Tensor:
    """One token per row from softmax(logits), by inverse CDF."""
    cdf = logits.softmax(-1).cumsum(-1)
    if not torch.isfinite(cdf[:, -1]).all():  # what torch.multinomial (HF generate) raises on such a distribution
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0 (the policy's logits are "
                           "not finite: training diverged?)")
    u = torch.rand((logits.size(0), 1), device=logits.device).clamp(min=1e-12) * cdf[:, -1:]
    return torch.searchsorted(cdf, u).squeeze(-1).clamp(max=logits.size(-1) - 1)


def _cut_at_eos(ids: list[list[int]], logps: list[list[float]], eos_ids: list[int]):
    eos = set(eos_ids)
    cut_ids, cut_logps = [], []
    for row, row_logps in zip(ids, logps, strict=True):
        end = next((i + 1 for i, tok in enumerate(row) if tok in eos), len(row))
        cut_ids.append(row[:end])
        cut_logps.append(row_logps[:end])
    return cut_ids, cut_logps
