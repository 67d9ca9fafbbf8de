"""runtime.generation_dtype: the runtime samples from a bf16 copy of the policy, refreshed before every rollout;
the loss then takes the sampled tokens' log-probs as the behaviour policy's, and the gap is logged."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.profiler import profile

from conftest import tiny_overrides
from grpo_pipeline.config.plan import generation_dtype as planned_dtype
from grpo_pipeline.config.schema import ModelConfig
from grpo_pipeline.errors import ConfigError
from grpo_pipeline.models import build_tiny_model, build_tiny_tokenizer
from grpo_pipeline.recipe import train
from grpo_pipeline.rollout import decode as sampler
from grpo_pipeline.rollout.policy_copy import MergedCopy
from grpo_pipeline.training.trainer import PipelineTrainer


def generation_dtype(cfg, multi_turn: bool = False):
    """The run plan's sampling dtype as a torch dtype (None: the model's own)."""
    name, _ = planned_dtype(cfg, multi_turn)
    return getattr(torch, name) if name else None


def _ids(tokenizer):
    return torch.tensor([tokenizer("count the apples and the pears, then the plums")["input_ids"]])


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_bf16_copy_follows_the_policy_and_is_refreshed():
    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(1)
    policy = get_peft_model(build_tiny_model(ModelConfig(name="tiny", source="tiny"), tokenizer),
                            LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
                                       init_lora_weights=False, lora_dropout=0.0)).eval()
    ids = _ids(tokenizer)
    copy16 = MergedCopy(torch.bfloat16)
    plain = copy16.of(policy)
    assert copy16.differs(policy) and not MergedCopy().differs(policy)
    assert {p.dtype for p in plain.parameters()} == {torch.bfloat16}
    assert not any("lora" in n for n, _ in plain.named_modules())
    gap = (_logits(plain, ids) - _logits(policy, ids)).abs().max().item()
    assert 0 < gap < 0.1  # bf16 rounding, not another model
    with torch.no_grad():  # an optimizer step on the adapter
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * 0.5)
    assert (_logits(plain, ids) - _logits(policy, ids)).abs().max().item() > 0.1  # stale until asked for again
    assert copy16.of(policy) is plain
    assert (_logits(plain, ids) - _logits(policy, ids)).abs().max().item() < 0.1


def test_bf16_copy_of_a_fully_trained_model_copies_every_weight():
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(ModelConfig(name="tiny", source="tiny"), tokenizer).eval()
    ids = _ids(tokenizer)
    assert MergedCopy().of(model) is model and MergedCopy(torch.float32).of(model) is model  # nothing to copy
    copy16 = MergedCopy(torch.bfloat16)
    plain = copy16.of(model)
    assert plain is not model and next(plain.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    assert copy16.of(model) is plain
    assert (_logits(plain, ids) - _logits(model, ids)).abs().max().item() < 0.1


def test_decode_hands_the_lm_head_a_contiguous_last_state():
    """With logits_to_keep=1, a prefill of several columns gave the LM head a strided view, and torch's matmul
    expanded the head's weight once per row for a copy without requires_grad (a bmm over [rows, hidden, vocab])."""
    tokenizer = build_tiny_tokenizer()
    model = MergedCopy(torch.bfloat16).of(build_tiny_model(ModelConfig(name="tiny", source="tiny"), tokenizer))
    ids = torch.randint(5, 100, (6, 12))
    assert sampler.last_position(ids[:, :1]) == 1
    assert sampler.last_position(ids).tolist() == [11]
    with torch.no_grad(), profile(record_shapes=True) as prof:
        tokens, _ = sampler.decode(model, ids, torch.ones_like(ids), 3, {"do_sample": False}, [0])
    vocab = model.config.vocab_size
    assert not [e for e in prof.events() if e.name == "aten::bmm" and any(vocab in s for s in e.input_shapes if s)]
    with torch.no_grad():  # the same tokens as the full-logits forward gives
        first = model(input_ids=ids).logits[:, -1].argmax(-1)
    assert [t[0] for t in tokens] == first.tolist()


def test_default_generation_dtype_follows_what_the_cpu_does(compose_cfg, tmp_path, monkeypatch):
    """oneDNN says bf16 is supported on any AVX-512 CPU; the choice goes by the CPU's flags and a measurement."""
    from grpo_pipeline.config import machine

    monkeypatch.setenv("GRPO_PIPELINE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU run, also on a GPU host
    cfg = compose_cfg(["model=tiny", f"output_dir={tmp_path}"])
    timings = []

    def fake_measure(packed, budget_s=0.12):
        timings.append(packed)
        return {"float32_ms": 10.0, "bfloat16_ms": speed["bf16"]}

    monkeypatch.setattr(machine, "measure", fake_measure)
    # an AVX-512 Xeon without AVX512-BF16/AMX (bf16 emulated): float32, nothing measured
    monkeypatch.setattr(machine, "cpu_flags", lambda: {"avx512f", "avx512bw", "avx512_vnni"})
    assert generation_dtype(cfg) is None and timings == []
    # native bf16, measured 2x faster: bfloat16; measured once, then read from the machine's cache
    monkeypatch.setattr(machine, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    speed = {"bf16": 5.0}
    assert generation_dtype(cfg) == torch.bfloat16
    assert generation_dtype(cfg) == torch.bfloat16 and len(timings) == 1
    assert generation_dtype(cfg, multi_turn=True) is None  # measured slower there: the model's own
    # native bf16 that measures barely faster (a memory-bound host): float32
    monkeypatch.setenv("GRPO_PIPELINE_CACHE", str(tmp_path / "cache2"))
    speed = {"bf16": 9.5}
    assert generation_dtype(cfg) is None and len(timings) == 2
    choice = machine.sampling_dtype(packed=True)
    assert choice.value == "float32" and "1.05x" in choice.why
    cfg = compose_cfg(["model=tiny", "runtime.generation_dtype=bfloat16", f"output_dir={tmp_path}"])
    assert generation_dtype(cfg) == torch.bfloat16  # asked for: also where it is emulated
    cfg = compose_cfg(["model=tiny", "runtime.generation_dtype=float32", f"output_dir={tmp_path}"])
    assert generation_dtype(cfg) is None  # the model's own


def test_the_machine_measurement_is_quick_and_real(tmp_path, monkeypatch):
    import time

    from grpo_pipeline.config import machine

    started = time.perf_counter()
    timing = machine.measure(packed=False)
    assert time.perf_counter() - started < 3 and timing["float32_ms"] > 0 and timing["bfloat16_ms"] > 0
    started = time.perf_counter()
    timing = machine.measure_packing()
    assert time.perf_counter() - started < 3 and timing["plain_ms"] > 0 and timing["packed_ms"] > 0


def test_unknown_generation_dtype_is_a_config_error(compose_cfg, tmp_path):
    """An Enum field: refused at compose time, naming the key and the allowed dtypes."""
    with pytest.raises(Exception) as e:
        compose_cfg([*tiny_overrides(tmp_path), "runtime.generation_dtype=int4"])
    text = str(e.value) + str(e.value.__cause__)
    assert "full_key: runtime.generation_dtype" in text and "bfloat16" in text


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_loss_ratio_is_against_the_sampler(compose_cfg, tmp_path, monkeypatch, dtype):
    seen = []
    original = PipelineTrainer._compute_loss

    def capture(self, model, inputs):
        seen.append({k: inputs.get(k) for k in ("old_per_token_logps", "sampling_per_token_logps", "completion_mask")})
        return original(self, model, inputs)

    monkeypatch.setattr(PipelineTrainer, "_compute_loss", capture)
    cfg = compose_cfg([*tiny_overrides(tmp_path), f"runtime.generation_dtype={dtype}"])
    result = train(cfg, launch_dir=str(tmp_path))
    assert result.steps == 2 and len(seen) == 2
    from grpo_pipeline.tracking.mlflow_run import metric_history

    gap = metric_history(f"sqlite:///{tmp_path / 'mlflow.db'}", result.mlflow_run_id,
                         "sampling/sampling_logp_difference/mean")
    if dtype == "float32":  # on-policy: TRL's own ratio against the trainer's log-probs, nothing to log
        assert all(s["old_per_token_logps"] is None for s in seen) and gap == []
        return
    for s in seen:  # PPO's ratio is over the log-probs of what sampled (the bf16 copy), as the rollout returned them
        assert torch.equal(s["old_per_token_logps"], s["sampling_per_token_logps"])
    assert len(gap) == 2 and all(0 <= g < 0.2 for g in gap) and max(gap) > 0  # bf16 rounding: small, not none


def test_packed_generation_follows_the_machine(compose_cfg, tmp_path, monkeypatch):
    from grpo_pipeline.config import plan
    from grpo_pipeline.rollout import policy_copy as merged

    def packed_generation(cfg):
        return plan.packed_generation(cfg)[0]

    from grpo_pipeline.config import machine

    cfg = compose_cfg(["model=tiny", f"output_dir={tmp_path}"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU run, also on a GPU host
    monkeypatch.setattr(merged, "can_pack", lambda: True)
    monkeypatch.setenv("GRPO_PIPELINE_CACHE", str(tmp_path / "cache"))
    measured = []
    monkeypatch.setattr(machine, "measure_packing", lambda: measured.append(1) or {"plain_ms": 14.0, "packed_ms": 10.0})
    assert packed_generation(cfg) is True  # a float32 copy on a CPU where packing measured 1.4x faster (AMD EPYC)
    assert "1.40x" in plan.packed_generation(cfg)[1] and measured == [1]  # measured once, then cached
    monkeypatch.setenv("GRPO_PIPELINE_CACHE", str(tmp_path / "cache2"))
    monkeypatch.setattr(machine, "measure_packing", lambda: {"plain_ms": 9.4, "packed_ms": 10.0})
    assert packed_generation(cfg) is False  # where it measured no faster (Intel Xeon with AMX: 0.94x)
    cfg.runtime.packed_generation = False
    assert packed_generation(cfg) is False
    cfg.runtime.packed_generation = None
    cfg.model.dtype = "bfloat16"
    assert packed_generation(cfg) is False  # not measured packed: torch's own matmul
    cfg.runtime.packed_generation = True
    with pytest.raises(ConfigError, match=r"runtime.packed_generation=true.*model.dtype=bfloat16"):
        packed_generation(cfg)  # oneDNN packs bf16 only on some CPUs: refused before any weights load
    cfg.runtime.packed_generation = None
    monkeypatch.setattr(merged, "can_pack", lambda: False)
    cfg.model.dtype = "float32"
    assert packed_generation(cfg) is False
    cfg.runtime.packed_generation = True
    with pytest.raises(ConfigError, match=r"runtime.packed_generation=true.*no oneDNN"):
        packed_generation(cfg)
