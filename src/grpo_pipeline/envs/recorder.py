"""What an env's own `model.generate` calls sampled during training, so that every turn of a seed-style env learns.

An env written the documents' way runs its episode inside `score_episode`, calling `model.generate` for turns
2, 3, ... itself. Each such call goes through the episode's `PolicyHandle` (policy.py); during training its
`CallRecorder` keeps, for every row of a call that sampled from the policy with the run's sampling settings,
the tokens the model saw (`prompt_ids`: the row's input ids without padding), the tokens it sampled
(`completion_ids`, up to and including the first eos) and their log-probabilities (log-softmax of the logits over
the run's temperature, as TRL computes the policy's). The trainer turns each into a training row of its own,
with its episode's advantage (training/turn_samples.py).

Where a call's input is, as text, the episode so far (its opening, the first reply, the turns recorded since) plus
the env's new tokens, as when the env renders its conversation with the chat template, the runtime's decode loop
samples it from the episode's own tokens plus the env's (`rebased`): text decoded and encoded again need not give
back the tokens sampled (about 2 replies in 5 of SmolLM2 at temperature 1 do not), and with the model's own tokens
the call continues its episode's training row token-exactly, so it is chained onto it (turn_samples.py `chained`).
The env still gets its own input ids back, followed by the tokens sampled.

A call is recorded only when it samples exactly as the run does: `do_sample` and the temperature, top-k and top-p
of the run (filled in by the handle where the env left them out), and nothing else that changes the distribution,
in the call or in the model's own `generation_config` (a repetition penalty, min_p, a minimum length, suppressed
tokens, ...; e.g. Qwen2.5-Instruct ships repetition_penalty=1.1), nor beams or several sequences per row. Other
calls (greedy, their own sampling) are kept out of the loss and counted as skipped: their tokens were not sampled
from the distribution the loss assumes.
"""

import functools
import threading
from dataclasses import dataclass

import torch

# what a recorded call may set besides the sampling keys, which must equal the run's
_NEUTRAL = {"max_new_tokens", "max_length", "pad_token_id", "eos_token_id", "use_cache", "attention_mask",
            "input_ids", "inputs"}
_SAMPLING = ("do_sample", "temperature", "top_k", "top_p")
# generate settings that change the sampling distribution, and the value that leaves it alone (None: unset)
_DISTORTING = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
               "min_length": 0, "min_new_tokens": 0, "min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0,
               "eta_cutoff": 0.0, "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None,
               "sequence_bias": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
               "exponential_decay_length_penalty": None, "num_beams": 1, "num_return_sequences": 1}


@dataclass(frozen=True)
class TurnSample:
    prompt_ids: list[int]  # what the model saw (no padding)
    completion_ids: list[int]  # what it sampled, up to and including the first eos
    logprobs: list[float]  # of each sampled token under the run's temperature
    ended: bool  # it sampled an eos (not cut by max_new_tokens)


class CallRecorder:
    """One episode's recorded samples (its env thread and the batcher's worker both add to it)."""

    def __init__(self, sampling: dict, episode_ids: list[int] | None = None, tokenizer=None):
        self.sampling = {k: sampling.get(k) for k in _SAMPLING if k in sampling}
        self.temperature = float(sampling.get("temperature") or 1.0)
        self.samples: list[TurnSample] = []
        self.skipped = 0  # calls that did not sample as the run does
        self.rebased_calls = 0  # rows recorded as sampled from the episode's own tokens (rebased)
        self._episode = list(episode_ids) if episode_ids and tokenizer is not None else None  # its tokens so far
        self._tokenizer = tokenizer
        self._lock = threading.Lock()

    def rebased(self, ids: list[int]) -> list[int]:
        """`ids` (a call's unpadded input) with its first part replaced by the episode's own tokens where that part
        decodes to exactly the episode's text so far; otherwise `ids` as they are."""
        episode = self._episode
        if episode is None or ids[: len(episode)] == episode:
            return ids
        decode = functools.partial(self._tokenizer.decode, skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
        text, n = decode(episode), len(episode)
        for k in sorted(range(max(1, n - _SLACK), min(len(ids), n + _SLACK) + 1), key=lambda k: abs(k - n)):
            if decode(ids[:k]) == text:
                new = episode + ids[k:]
                return new if decode(new) == decode(ids) else ids  # the same text, or nothing changes
        return ids

    def accepts(self, args: tuple, kwargs: dict, model=None) -> bool:
        """Whether this call (its kwargs as the handle completed them, on `model`) samples from the policy as the
        run does; counts it as skipped when not."""
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
        config = getattr(model, "generation_config", None)
        ok = (len(args) <= 1 and isinstance(ids, torch.Tensor) and ids.dim() == 2
              and ids.dtype in (torch.int, torch.long) and bool(kwargs.get("do_sample"))
              and not set(kwargs) - _NEUTRAL - set(_SAMPLING)
              and all(kwargs.get(k) == v for k, v in self.sampling.items())
              and all(getattr(config, k, None) in (None, neutral) for k, neutral in _DISTORTING.items()))
        if not ok:
            with self._lock:
                self.skipped += 1
        return ok

    def generate(self, model, args: tuple, kwargs: dict) -> torch.Tensor:
        """`model.generate(*args, **kwargs)` on its own, recorded; returns what the env's call would."""
        from grpo_pipeline.envs.batching import _inferred_attention_mask

        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
        rest = {k: v for k, v in kwargs.items() if k not in ("input_ids", "inputs")}
        out = model.generate(ids, **rest, output_logits=True, return_dict_in_generate=True)
        if not hasattr(out, "sequences") or not getattr(out, "logits", None):  # a model whose generate ignores them
            self.unrecordable()
            return out
        eos = _eos_ids(model, kwargs)
        mask = kwargs.get("attention_mask")
        if mask is None:  # the mask generate inferred
            pad = kwargs.get("pad_token_id", getattr(getattr(model, "generation_config", None), "pad_token_id", None))
            mask = _inferred_attention_mask(ids, pad if pad is not None else (eos[0] if eos else None),
                                            torch.tensor(eos, dtype=torch.long))
        generated = out.sequences[:, ids.shape[1]:]
        self.add(ids, mask, generated, sampled_logps(out.logits, generated, self.temperature), eos)
        return out.sequences

    def unrecordable(self) -> None:
        """A call accepted whose generate returned no per-step logits: not trained, counted as skipped."""
        with self._lock:
            self.skipped += 1

    def add(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, generated: torch.Tensor,
            logps: torch.Tensor, eos_ids: list[int], prompts: list[list[int]] | None = None) -> None:
        """Rows of one call: its (left-padded) input, the tokens generated after it, and each generated token's
        log-prob ([rows, tokens]; `sampled_logps`). `prompts`: what each row was sampled from, where that is not
        its input (`rebased`). A one-row call that continues the episode extends it."""
        samples, rebased = [], 0
        input_ids, attention_mask, generated, logps = (t.cpu() for t in (input_ids, attention_mask, generated, logps))
        for row in range(input_ids.size(0)):
            prompt = own = input_ids[row][attention_mask[row].bool()].tolist()
            if prompts is not None:
                prompt = prompts[row]
                rebased += prompt != own
            ids = generated[row, : logps.size(1)].tolist()
            end = next((i + 1 for i, t in enumerate(ids) if t in eos_ids), None)
            ids = ids[:end] if end is not None else ids
            if ids:
                samples.append(TurnSample(prompt, ids, logps[row, : len(ids)].tolist(), end is not None))
        with self._lock:
            self.samples += samples
            self.rebased_calls += rebased
            episode = self._episode
            if episode is not None and len(samples) == 1 == input_ids.size(0) and \
                    samples[0].prompt_ids[: len(episode)] == episode:
                self._episode = samples[0].prompt_ids + samples[0].completion_ids


_SLACK = 16  # how many tokens the episode's text may take more or fewer of in a call's input


def sampled_logps(logits: tuple[torch.Tensor, ...], generated: torch.Tensor, temperature: float) -> torch.Tensor:
    """[rows, steps] log-probs of the generated tokens under `temperature`, from generate's raw per-step logits
    (`output_logits=True`), one step at a time where the logits are: never the whole [rows, steps, vocab] at once."""
    columns = []
    for step, step_logits in enumerate(logits[: generated.size(1)]):
        tokens = generated[:, step].to(step_logits.device)
        logp = torch.log_softmax(step_logits.float() / temperature, dim=-1)
        columns.append(logp.gather(-1, tokens[:, None]).squeeze(-1))
    return torch.stack(columns, dim=1) if columns else torch.zeros((generated.size(0), 0))


def _eos_ids(model, kwargs: dict) -> list[int]:
    eos = kwargs.get("eos_token_id")
    if eos is None:
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist()
    return [] if eos is None else [int(e) for e in (eos if isinstance(eos, list | tuple) else [eos])]
