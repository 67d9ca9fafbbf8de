"""What an env's own `model.generate` calls sampled during training, so that every turn of a seed-style env learns.

An env written the documents' way runs its episode inside `score_episode`, calling `model.generate` for turns
2, 3, ... itself. Each such call goes through the episode's `PolicyHandle` (policy.py); during training its
`CallRecorder` keeps, for every row of a call that sampled from the policy with the run's sampling settings,
the tokens the model saw (`prompt_ids`: the row's input ids without padding), the tokens it sampled
(`completion_ids`, up to and including the first eos) and their log-probabilities (log-softmax of the logits over
the run's temperature, as TRL computes the policy's). The trainer turns each into a training row of its own,
with its episode's advantage (training/turn_samples.py).

A call is recorded only when it samples exactly as the run does: `do_sample` and the temperature, top-k and top-p
of the run (filled in by the handle where the env left them out) and nothing that changes the distribution
(`logits_processor`, `generation_config`, a repetition penalty, beams, several sequences per row). Other calls
(greedy, their own sampling) are kept out of the loss and counted as skipped: their tokens were not sampled from
the policy the loss assumes.
"""

import threading
from dataclasses import dataclass

import torch

# what a recorded call may set besides the sampling keys, which must equal the run's
_NEUTRAL = {"max_new_tokens", "max_length", "pad_token_id", "eos_token_id", "use_cache", "attention_mask",
            "input_ids", "inputs", "min_new_tokens"}
_SAMPLING = ("do_sample", "temperature", "top_k", "top_p")


@dataclass(frozen=True)
class TurnSample:
    prompt_ids: list[int]  # what the model saw (no padding)
    completion_ids: list[int]  # what it sampled, up to and including the first eos
    logprobs: list[float]  # of each sampled token under the run's temperature
    ended: bool  # it sampled an eos (not cut by max_new_tokens)


class CallRecorder:
    """One episode's recorded samples (its env thread and the batcher's worker both add to it)."""

    def __init__(self, sampling: dict):
        self.sampling = {k: sampling.get(k) for k in _SAMPLING if k in sampling}
        self.temperature = float(sampling.get("temperature") or 1.0)
        self.samples: list[TurnSample] = []
        self.skipped = 0  # calls that did not sample as the run does
        self._lock = threading.Lock()

    def accepts(self, args: tuple, kwargs: dict) -> bool:
        """Whether this call (its kwargs as the handle completed them) samples from the policy as the run does;
        counts it as skipped when not."""
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
        ok = (len(args) <= 1 and isinstance(ids, torch.Tensor) and ids.dim() == 2
              and ids.dtype in (torch.int, torch.long) and bool(kwargs.get("do_sample"))
              and not set(kwargs) - _NEUTRAL - set(_SAMPLING)
              and all(kwargs.get(k) == v for k, v in self.sampling.items()))
        if not ok:
            with self._lock:
                self.skipped += 1
        return ok

    def generate(self, model, args: tuple, kwargs: dict) -> torch.Tensor:
        """`model.generate(*args, **kwargs)` on its own, recorded; returns what the env's call would."""
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
        rest = {k: v for k, v in kwargs.items() if k not in ("input_ids", "inputs")}
        out = model.generate(ids, **rest, output_logits=True, return_dict_in_generate=True)
        mask = kwargs.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask
        self.add(ids, mask, out.sequences[:, ids.shape[1]:], torch.stack(out.logits, dim=1), _eos_ids(model, kwargs))
        return out.sequences

    def add(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, generated: torch.Tensor,
            logits: torch.Tensor, eos_ids: list[int]) -> None:
        """Rows of one call: its (left-padded) input, the tokens generated after it, and the raw logits of each
        generated position ([rows, tokens, vocab])."""
        logps = torch.log_softmax(logits.float() / self.temperature, dim=-1)
        logps = logps.gather(-1, generated[:, : logps.size(1), None].to(logps.device)).squeeze(-1)
        samples = []
        for row in range(input_ids.size(0)):
            prompt = input_ids[row][attention_mask[row].bool()].tolist()
            ids = generated[row, : logps.size(1)].tolist()
            end = next((i + 1 for i, t in enumerate(ids) if t in eos_ids), None)
            ids = ids[:end] if end is not None else ids
            if ids:
                samples.append(TurnSample(prompt, ids, logps[row, : len(ids)].tolist(), end is not None))
        with self._lock:
            self.samples += samples


def _eos_ids(model, kwargs: dict) -> list[int]:
    eos = kwargs.get("eos_token_id")
    if eos is None:
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return [] if eos is None else [int(e) for e in (eos if isinstance(eos, list | tuple) else [eos])]
