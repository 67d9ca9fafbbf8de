"""A merged copy of a LoRA policy for generation: plain linear layers holding W + (alpha/r) * B @ A.

Decoding a LoRA model runs two extra small matmuls (and a dropout) per adapted layer and token; on a CPU,
where a decode step is a few dozen milliseconds, that overhead is a large share (measured in
`scripts/bench_step.py`). vLLM and other inference engines serve merged weights for the same reason. This copy
is refreshed from the policy's current adapter every time it is asked for (one small matmul per adapted layer,
milliseconds), so it can never be a step stale, also after `model/` gets the best step's weights back.
It costs one copy of the model's memory; `runtime.merged_generation` turns it off.
"""

import copy

import torch

_PEFT_PREFIX = "base_model.model."


class MergedCopy:
    def __init__(self):
        self._copy = None
        self._pairs: list[tuple[torch.nn.Module, torch.nn.Module]] = []  # (policy's LoRA layer, copy's Linear)

    def of(self, policy):
        """The model to generate with: `policy` itself unless it has LoRA adapters, else the refreshed copy."""
        layers = _lora_layers(policy)
        if not layers:
            return policy
        if self._copy is None:
            self._build(policy, layers)
        with torch.no_grad():
            for lora, plain in self._pairs:
                base = lora.base_layer.weight
                delta = sum(lora.get_delta_weight(name) for name in lora.active_adapters if name in lora.lora_A)
                plain.weight.copy_(base + delta if torch.is_tensor(delta) else base)
        return self._copy

    def _build(self, policy, layers: dict[str, torch.nn.Module]) -> None:
        merged = copy.deepcopy(policy).merge_and_unload()
        # TRL patches the policy's forward (fused LM head) with a closure over the *original* model: the copy must
        # run its own class's forward
        merged.__dict__.pop("forward", None)
        merged.eval().requires_grad_(False)
        self._pairs = [(lora, merged.get_submodule(name.removeprefix(_PEFT_PREFIX))) for name, lora in layers.items()]
        self._copy = merged


def _lora_layers(model) -> dict[str, torch.nn.Module]:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        return {}
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
