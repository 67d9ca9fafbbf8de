"""KL to the base model at validation steps (`eval_val/kl_to_base`), whatever loss.kl_coef is.

TRL logs `kl` only when beta (loss.kl_coef) != 0, and the default loss (dapo) has none: a policy drifting far
from the model it started from is otherwise invisible. At every validation the policy and the reference score the
validation completions (the greedy episodes just scored), and the per-token estimator TRL uses (k3:
exp(ref - logp) - (ref - logp) - 1, Schulman's unbiased, non-negative estimate) is averaged over the tokens the
model generated (a multi-turn episode's env tokens are left out).

The reference: with LoRA, the policy with its adapter switched off (peft's `disable_adapter()`: no second model
in memory); without LoRA, TRL's reference model when loss.kl_coef > 0; full fine-tuning with kl_coef=0 keeps no
reference (a second copy of every weight), so nothing is computed and the log says so once.
Log-probs come from the trainer's own `_get_per_token_logps_and_entropies` (TRL 1.16; the shared-prefix path
where it applies), so they are TRL's, at the sampling temperature: the value reads like TRL's `kl`.
"""

import contextlib
import logging

import torch

log = logging.getLogger(__name__)
DRIFT = 0.5  # the GRPO tutorials' threshold: above it the policy is drifting far from the base model


class KlToBase:
    def __init__(self, trainer, batch_size: int, policy):
        """`policy`: the trainer's model unwrapped (for_trainer)."""
        self.trainer, self.batch_size, self.policy = trainer, batch_size, policy

    @classmethod
    def for_trainer(cls, trainer, batch_size: int) -> "KlToBase | None":
        """None (said once in the log) when the run keeps no reference model."""
        policy = trainer.accelerator.unwrap_model(trainer.model)
        if hasattr(policy, "disable_adapter") or getattr(trainer, "ref_model", None) is not None:
            return cls(trainer, batch_size, policy)
        log.warning("eval_val/kl_to_base is not computed: full fine-tuning with loss.kl_coef=0 keeps no reference "
                    "model (it would be a second copy of every weight). Set loss.kl_coef > 0 or use LoRA to see it.")
        return None

    def _reference(self):
        if hasattr(self.policy, "disable_adapter"):
            return self.trainer.model, self.policy.disable_adapter()
        return self.trainer.ref_model, contextlib.nullcontext()

    @torch.no_grad()
    def __call__(self, sequences: list[tuple[list[int], list[int], list[int]]]) -> float | None:
        """The mean per-token KL over (prompt ids, completion ids, mask of the tokens the model generated)."""
        sequences = [s for s in sequences if any(s[2])]
        if not sequences:
            return None
        was_training = self.policy.training
        self.policy.eval()
        total, tokens = 0.0, 0
        try:
            for start in range(0, len(sequences), self.batch_size):
                ids, attention, keep, mask = _batch(sequences[start : start + self.batch_size],
                                                    self.trainer.processing_class.pad_token_id, self.policy.device)
                logps = self._logps(self.trainer.model, ids, attention, keep)
                model, reference = self._reference()
                with reference:
                    ref_logps = self._logps(model, ids, attention, keep)
                delta = ref_logps - logps
                per_token = torch.exp(delta) - delta - 1  # TRL's k3
                total += float((per_token * mask).sum())
                tokens += int(mask.sum())
        finally:
            self.policy.train(was_training)
        return total / tokens

    def _logps(self, model, ids, attention, keep):
        logps, _, _ = self.trainer._get_per_token_logps_and_entropies(model, ids, attention, keep)
        return logps.float()


def _batch(sequences, pad_id: int, device):
    """TRL's layout: prompts left-padded, completions right-padded; logits_to_keep = the longest completion."""
    prompt_len = max(len(p) for p, _, _ in sequences)
    keep = max(len(c) for _, c, _ in sequences)
    ids, attention, mask = [], [], []
    for prompt, completion, generated in sequences:
        left, right = prompt_len - len(prompt), keep - len(completion)
        ids.append([pad_id] * left + list(prompt) + list(completion) + [pad_id] * right)
        attention.append([0] * left + [1] * (len(prompt) + len(completion)) + [0] * right)
        mask.append(list(generated) + [0] * right)
    as_tensor = lambda rows: torch.tensor(rows, device=device)  # noqa: E731
    return as_tensor(ids), as_tensor(attention), keep, as_tensor(mask).float()


def warn_if_drifting(value: float | None, step: int) -> None:
    if value is not None and value > DRIFT:
        log.warning("validation step %d: eval_val/kl_to_base %.3f > %g: the policy is drifting far from the base "
                    "model: lower the learning rate (training.learning_rate) or raise loss.kl_coef.", step, value,
                    DRIFT)
