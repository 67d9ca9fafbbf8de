"""Run-time guarantees that the sampler samples the policy being trained (`sentinel.*`).

Users of GRPO frameworks lose days to runs that go on while the sampler generates from stale or adapter-less
weights (unsloth PR #8701: LoRA silently ignored on TRL 1.10) or while its log-probs drift from the trainer's
(trl #4159, #6789). Two checks, both on by default:

- `WeightsSentinel`, before the first training rollout and every `sentinel.every_steps` steps after, on the
  runtime's merged copy (rollout/policy_copy.py): the policy and the copy that will sample each score a fixed probe
  of 16 tokens (one forward each; a forward reads every weight, ~0.07 s on SmolLM2 on 2 cores, so not every step).
  The copy matches when its log-probs of the policy's most likely tokens are within the dtype's noise of the
  policy's; past it, the base model (the adapter switched off) scores the probe too, and the copy still matches if it
  is closer to the policy than the adapter's whole effect (a copy that missed the adapter, or was not refreshed for
  several steps, sits at the base model's or an old step's values). A mismatch stops the run, naming the path. Logged: `sentinel/weights_match` (1/0), `sentinel/weights_gap`,
  `sentinel/adapter_effect` and `sentinel/seconds`. Where TRL generates from the policy itself there is no copy to
  check; the runtime's vLLM engine is not probed (its log-prob gap below is the check there).
- `LogpGapWatch` (trainer.py): the gap between the sampler's log-probs and the trainer's on the tokens trained
  (`sentinel/logp_gap_max`, TRL's sampling/sampling_logp_difference/max where TRL computes it). Past
  `sentinel.logp_gap_warn` it warns; past `sentinel.logp_gap_stop` for `sentinel.patience` steps in a row it stops.

Top-k / top-p (trl #6789): the sampler's log-probs here are log-softmax(logits / T) before top-k/top-p, as TRL
computes the trainer's, so the importance ratio compares like with like (tests/test_sentinels.py checks the recorded
values under top-k against the untruncated teacher-forced ones). The tokens themselves come from the truncated
distribution, in TRL's path and vLLM's alike; that changes the objective, not the ratio.
"""

import logging
import time

import torch

from grpo_pipeline.errors import PipelineError

log = logging.getLogger(__name__)
PROBE_TOKENS = 16


class SamplerStale(PipelineError):
    """The weights the sampler uses are not the policy's current ones."""


class WeightsSentinel:
    def __init__(self, path: str, noise: float | None = None, every_steps: int = 1):
        self.path = path  # names the sampler in messages, e.g. "the runtime's merged bfloat16 copy"
        self.noise = noise  # the dtype's gap on a correct copy; None: measured at the first check
        self.every_steps = max(1, every_steps)
        self.probe: torch.Tensor | None = None
        self.last_step: int | None = None  # of the last check

    def check(self, policy, sampler, context: list[int], step: int) -> dict[str, float]:
        """Probe `sampler` against `policy` (from the first PROBE_TOKENS of `context`, kept for the whole run);
        raises SamplerStale on a mismatch; returns the sentinel/* metrics."""
        if self.last_step is not None and step < self.last_step + self.every_steps:
            return {}
        self.last_step = step
        started = time.monotonic()
        if self.probe is None:
            self.probe = torch.tensor([context[:PROBE_TOKENS]])
        if sampler is policy:
            return {"sentinel/weights_match": 1.0, "sentinel/weights_gap": 0.0,
                    "sentinel/seconds": time.monotonic() - started}
        with torch.no_grad():
            mine = _logps(policy, self.probe)
            top = mine.argmax(-1, keepdim=True)
            theirs = _logps(sampler, self.probe).gather(-1, top)
            mine = mine.gather(-1, top)
            gap = (mine - theirs).abs().max().item()
            if self.noise is None:  # first check: the copy was just built from the policy: what remains is the dtype's
                # noise (a float32 copy: ~1e-5; a bf16 one: ~0.1-0.2 nats, growing with the adapter, hence the floor)
                exact = next(sampler.parameters()).dtype == torch.float32
                self.noise = max(3 * gap, 1e-3 if exact else 0.1)
            effect = 0.0
            if gap > self.noise:  # past the noise: is the copy nearer the policy than the adapter's whole effect?
                base = _base_logps(policy, self.probe)
                effect = 0.0 if base is None else (mine - base.gather(-1, top)).abs().max().item()
        matched = gap <= self.noise or gap < 0.5 * effect
        metrics = {"sentinel/weights_match": float(matched), "sentinel/weights_gap": gap,
                   "sentinel/adapter_effect": effect, "sentinel/seconds": time.monotonic() - started}
        if not matched:
            raise SamplerStale(
                f"Sentinel at step {step}: {self.path} does not hold the policy's current weights: on a fixed probe its "
                f"log-probs differ from the policy's by up to {gap:.3f} (a correct copy: <= {self.noise:.3f}; the "
                f"adapter's whole effect: {effect:.3f}). It samples an older or adapter-less model, so training would "
                "go on learning from the wrong samples. The weights trained so far are in model-interrupted/. Check "
                "that the copy is refreshed before every rollout (rollout/policy_copy.py MergedCopy.of) and that the "
                "adapter is active; runtime.merged_generation=false samples from the policy itself.")
        return metrics


class LogpGapWatch:
    """The sampler's vs the trainer's log-probs on the tokens trained, step by step."""

    def __init__(self, warn: float, stop: float, patience: int):
        self.warn, self.stop, self.patience = warn, stop, patience
        self.over = 0  # steps in a row past `stop`
        self.warned = False

    def observe(self, gap_max: float, gap_mean: float, step: int) -> None:
        if gap_max > self.warn and not self.warned:
            self.warned = True
            log.warning("Sentinel: the sampler's log-probs differ from the trainer's by up to %.2f nats on a token "
                        "trained at step %d (mean %.4f; sentinel.logp_gap_warn=%g). Check the sampling dtype "
                        "(runtime.generation_dtype), weight sync (vllm.weight_sync) and top-k/top-p settings.",
                        gap_max, step, gap_mean, self.warn)
        self.over = self.over + 1 if gap_max > self.stop else 0
        if self.over >= self.patience:
            raise SamplerStale(
                f"Sentinel at step {step}: for {self.over} steps in a row the sampler's log-probs differed from the "
                f"trainer's by more than sentinel.logp_gap_stop={self.stop:g} nats on a token trained (now up to "
                f"{gap_max:.2f}, mean {gap_mean:.4f}): the samples do not come from the policy being trained. Check "
                "the sampling dtype (runtime.generation_dtype=float32 samples in the trainer's), the weight sync "
                "(vllm.weight_sync) and that generation.temperature is the one the trainer uses. The weights trained "
                "so far are in model-interrupted/.")


def _logps(model, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids.to(model.device))
    return torch.log_softmax(out.logits[0].float(), dim=-1)


def _base_logps(policy, ids: torch.Tensor) -> torch.Tensor | None:
    """The base model's log-probs (the adapter switched off), or None without an adapter."""
    disable = getattr(policy, "disable_adapter", None)
    if disable is None:
        return None
    with disable():
        return _logps(policy, ids)
