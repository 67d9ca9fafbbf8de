"""The copy of the policy the runtime generates from: LoRA merged into plain linear layers, optionally in bf16,
and on a CPU with its linear layers' weights prepacked for oneDNN.

Decoding a LoRA model runs two extra small matmuls (and a dropout) per adapted layer and token; on a CPU,
where a decode step is a few dozen milliseconds, that overhead is a large share (measured in
`scripts/bench/step.py`). vLLM and other inference engines serve merged weights for the same reason. Decoding
is also bound by reading the weights (`scripts/bench/decode.py`): a bf16 copy reads half the bytes, and CPUs
with native bf16 (AVX512-BF16, AMX) run its matmuls faster (`runtime.generation_dtype`).

Prepacked weights (`PackedLinear`, `runtime.packed_generation`): a decode step multiplies a few rows by every
weight, and torch's default CPU matmul (MKL sgemm) streams the weights from memory at ~3 GB/s there, where
oneDNN's matmul over weights reordered once into its own blocked layout (`mkldnn._reorder_linear_weight`, what
torch.compile's CPU freezing uses) reads them at ~6 GB/s: a decode step of 8 rows 1.40-1.45x faster
(`scripts/bench/decode.py`; with 32 rows and a 500-token KV cache, ~1x). Same float32 arithmetic in
another summation order: log-probs within ~1e-5 of the plain layers'.

The copy is refreshed from the policy every time it is asked for (one small matmul per adapted layer, or one
copy of every weight without LoRA, plus the repacking: well under a second on SmolLM2), so it can never be a step
stale, also after `model/` gets the best step's weights back. It costs one copy of the model's memory (two when
packed; also without LoRA, where an unpacked float32 run generates from the policy itself);
`runtime.merged_generation` turns it off.
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


def can_pack() -> bool:
    """This torch runs oneDNN's prepacked linear (x86 and ARM CPU builds)."""
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return (torch.backends.mkldnn.is_available() and ops is not None
                and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))
    except (AttributeError, RuntimeError):  # pragma: no cover - torch builds without oneDNN
        return False


class PackedLinear(torch.nn.Module):
    """A Linear layer for inference whose weight is also held reordered for oneDNN's matmul. `weight` and `bias`
    stay the layer's own parameters (shared, so a tied LM head stays tied); call `repack()` after changing them.
    The packed tensor is an opaque oneDNN tensor outside the state dict: a model holding these layers cannot be
    deep-copied or pickled, and `.to()` would move `weight` but not `packed`. Only MergedCopy's copy holds them,
    and it is never saved, copied or moved."""

    ROWS_HINT = 8  # the rows oneDNN chooses its layout for; measured 8-256 alike, 1 slower (bench/decode.py)

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.repack()

    def repack(self) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), self.ROWS_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")


def pack_linears(model: torch.nn.Module) -> list[PackedLinear]:
    """Every nn.Linear of `model` replaced, in place, by a PackedLinear holding the same parameters."""
    packed = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                layer = PackedLinear(child)
                setattr(parent, name, layer)
                packed.append(layer)
    return packed


class MergedCopy:
    def __init__(self, dtype: torch.dtype | None = None, pack: bool = False):
        self.dtype = dtype  # None: the policy's own
        self.pack = pack  # linear layers prepacked for oneDNN (PackedLinear): a CPU copy in float32
        self._copy = None
        self._pairs: list[tuple[torch.nn.Module, torch.nn.Module]] = []  # (policy's LoRA layer, copy's Linear)
        self._packed: list[PackedLinear] = []  # the copy's packed layers

    def differs(self, policy) -> bool:
        """What generates samples from another distribution than the policy (other dtype): the trainer must then
        take the sampled log-probs as the behaviour policy's (trainer.PipelineTrainer.behaviour_logps)."""
        return self.dtype is not None and self.dtype != next(policy.parameters()).dtype

    def of(self, policy):
        """The model to generate with: `policy` itself unless it has LoRA adapters or generates in another dtype,
        else the refreshed copy."""
        layers = _lora_layers(policy)
        if not layers and not self.differs(policy) and not self.pack:
            return policy
        if self._copy is None:  # built from the policy as it is now: merged (and packed) already
            self._build(policy, layers)
            return self._copy
        with torch.no_grad():
            if layers:  # only the adapters train
                for lora, plain in self._pairs:
                    base = lora.base_layer.weight
                    delta = sum(lora.get_delta_weight(name) for name in lora.active_adapters if _has_adapter(lora, name))
                    plain.weight.copy_(base + delta if torch.is_tensor(delta) else base)
                    if isinstance(plain, PackedLinear):
                        plain.repack()
            else:  # every weight trains
                for mine, theirs in zip(self._copy.parameters(), policy.parameters(), strict=True):
                    mine.copy_(theirs)
                for layer in self._packed:
                    layer.repack()
        return self._copy

    def _build(self, policy, layers: dict[str, torch.nn.Module]) -> None:
        merged = copy.deepcopy(policy)
        if layers:
            merged = merged.merge_and_unload()
            _untie_adapted_head(policy, merged, layers)
        # TRL patches the policy's forward (fused LM head) with a closure over the *original* model: the copy must
        # run its own class's forward
        merged.__dict__.pop("forward", None)
        if self.dtype is not None:
            merged.to(self.dtype)
        merged.eval().requires_grad_(False)
        first = next(merged.parameters())
        # oneDNN packs float32 weights on any x86 CPU; bf16 only on some (packed_generation() refuses other dtypes)
        self._packed = pack_linears(merged) if self.pack and first.dtype == torch.float32 and first.is_cpu else []
        self._pairs = [(lora, merged.get_submodule(name.removeprefix(_PEFT_PREFIX))) for name, lora in layers.items()]
        self._copy = merged


def _has_adapter(lora, name: str) -> bool:
    """The LoRA layer holds adapter `name` (an adapted embedding keeps its matrices in lora_embedding_A/B)."""
    return name in lora.lora_A or name in getattr(lora, "lora_embedding_A", {})


def _untie_adapted_head(policy, merged, layers: dict[str, torch.nn.Module]) -> None:
    """An LM head tied to an embedding that LoRA adapts reads the embedding's base weight in the policy (the adapter
    applies to the lookup only), but merging writes the delta into the shared tensor: the copy's head gets its own
    frozen copy of the base weight instead."""
    head = policy.get_output_embeddings()
    for lora in layers.values():
        base = getattr(lora, "base_layer", None)
        if isinstance(base, torch.nn.Embedding) and head is not None and getattr(head, "weight", None) is base.weight:
            merged.get_output_embeddings().weight = torch.nn.Parameter(base.weight.detach().clone(),
                                                                       requires_grad=False)


def _lora_layers(model) -> dict[str, torch.nn.Module]:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        return {}
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
