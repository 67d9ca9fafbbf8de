"""The copy of the policy the runtime generates from: LoRA merged into plain linear layers, optionally in bf16.

Decoding a LoRA model runs two extra small matmuls (and a dropout) per adapted layer and token; on a CPU,
where a decode step is a few dozen milliseconds, that overhead is a large share (measured in
`scripts/bench_step.py`). vLLM and other inference engines serve merged weights for the same reason. Decoding
is also bound by reading the weights (`scripts/bench_decode.py`): a bf16 copy reads half the bytes, and CPUs
with native bf16 (AVX512-BF16, AMX) run its matmuls faster (`runtime.generation_dtype`).

The copy is refreshed from the policy every time it is asked for (one small matmul per adapted layer, or one
copy of every weight without LoRA: milliseconds), so it can never be a step stale, also after `model/` gets the
best step's weights back. It costs one copy of the model's memory; `runtime.merged_generation` turns it off.
"""

import copy

import torch

_PEFT_PREFIX = "base_model.model."


def native_bf16() -> bool:
    """This CPU runs bf16 matmuls natively (oneDNN's check: AVX512-BF16 or AMX); elsewhere bf16 is emulated."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # pragma: no cover - torch builds without oneDNN
        return False


class MergedCopy:
    def __init__(self, dtype: torch.dtype | None = None):
        self.dtype = dtype  # None: the policy's own
        self._copy = None
        self._pairs: list[tuple[torch.nn.Module, torch.nn.Module]] = []  # (policy's LoRA layer, copy's Linear)

    def differs(self, policy) -> bool:
        """What generates samples from another distribution than the policy (other dtype): the trainer must then
        take the sampled log-probs as the behaviour policy's (trainer.PipelineTrainer.behaviour_logps)."""
        return self.dtype is not None and self.dtype != next(policy.parameters()).dtype

    def of(self, policy):
        """The model to generate with: `policy` itself unless it has LoRA adapters or generates in another dtype,
        else the refreshed copy."""
        layers = _lora_layers(policy)
        if not layers and not self.differs(policy):
            return policy
        if self._copy is None:
            self._build(policy, layers)
        with torch.no_grad():
            if layers:  # only the adapters train
                for lora, plain in self._pairs:
                    base = lora.base_layer.weight
                    delta = sum(lora.get_delta_weight(name) for name in lora.active_adapters if name in lora.lora_A)
                    plain.weight.copy_(base + delta if torch.is_tensor(delta) else base)
            else:  # every weight trains
                for mine, theirs in zip(self._copy.parameters(), policy.parameters(), strict=True):
                    mine.copy_(theirs)
        return self._copy

    def _build(self, policy, layers: dict[str, torch.nn.Module]) -> None:
        merged = copy.deepcopy(policy)
        if layers:
            merged = merged.merge_and_unload()
        # TRL patches the policy's forward (fused LM head) with a closure over the *original* model: the copy must
        # run its own class's forward
        merged.__dict__.pop("forward", None)
        if self.dtype is not None:
            merged.to(self.dtype)
        merged.eval().requires_grad_(False)
        self._pairs = [(lora, merged.get_submodule(name.removeprefix(_PEFT_PREFIX))) for name, lora in layers.items()]
        self._copy = merged


def _lora_layers(model) -> dict[str, torch.nn.Module]:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        return {}
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
