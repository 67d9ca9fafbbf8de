"""Our user-facing names reach TRL's GRPOConfig in one place."""

import torch

from grpo_pipeline.config.grpo_args import build_grpo_config, grpo_kwargs


def test_user_names_map_onto_trl(compose_cfg, tmp_path):
    cfg = compose_cfg([
        "model=tiny", "loss=grpo", "loss.kl_coef=0.07", "loss.clip_range=0.15", "loss.epsilon_high=0.3",
        "loss.mask_truncated_completions=true", "generation.max_new_tokens=77", "generation.temperature=0.7",
        "generation.top_k=20", "generation.top_p=0.9", "generation.num_generations=4", "training.batch_size=8",
        "training.num_epochs=2", "training.learning_rate=1e-4", f"output_dir={tmp_path}",
    ])
    kw = grpo_kwargs(cfg, str(tmp_path), reward_weights=[1.0])
    assert kw["beta"] == 0.07 and kw["epsilon"] == 0.15 and kw["epsilon_high"] == 0.3
    assert kw["max_completion_length"] == 77 and kw["temperature"] == 0.7
    assert kw["top_k"] == 20 and kw["top_p"] == 0.9 and kw["num_generations"] == 4
    assert kw["loss_type"] == "grpo" and kw["mask_truncated_completions"] is True
    # dynamic sampling: TRL samples batch_size x oversample completions, the trainer keeps batch_size of them
    assert cfg.generation.oversample == 2 and kw["per_device_train_batch_size"] == 16 and kw["num_train_epochs"] == 2
    cfg.generation.oversample = 1
    assert grpo_kwargs(cfg, str(tmp_path), reward_weights=[1.0])["per_device_train_batch_size"] == 8
    assert kw["use_vllm"] is False and kw["remove_unused_columns"] is False
    args = build_grpo_config(cfg, str(tmp_path), [1.0])
    assert (args.beta, args.epsilon, args.loss_type, args.max_completion_length) == (0.07, 0.15, "grpo", 77)
    assert args.use_cpu is True and args.report_to == []


def test_vllm_modes_map_onto_trl(compose_cfg, tmp_path, monkeypatch):
    from grpo_pipeline.config.validate import weight_sync

    cfg = compose_cfg(["vllm=server", "vllm.server_port=8123", f"output_dir={tmp_path}"])
    kw = grpo_kwargs(cfg, str(tmp_path))
    assert kw["use_vllm"] is True and kw["vllm_mode"] == "server" and kw["vllm_server_port"] == 8123
    full = compose_cfg(["vllm=colocate", "lora=off", "vllm.gpu_memory_utilization=0.5", f"output_dir={tmp_path}"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # full fine-tuning on a CPU: the runtime's engine, the weights loaded in place (TRL's push fails there)
    assert grpo_kwargs(full, str(tmp_path))["use_vllm"] is False and weight_sync(full) == "weights"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    kw = grpo_kwargs(full, str(tmp_path))  # full fine-tuning on GPUs: TRL's vLLM (it pushes the weights)
    assert kw["use_vllm"] is True and kw["vllm_mode"] == "colocate" and kw["vllm_gpu_memory_utilization"] == 0.5
    lora = compose_cfg(["vllm=colocate", f"output_dir={tmp_path}"])
    assert weight_sync(lora) == "adapter"  # LoRA on GPUs: vLLM's multi-LoRA kernels
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert weight_sync(lora) == "weights"  # on a CPU: merged weights (docs/results.md)
    assert weight_sync(compose_cfg(["vllm=colocate", "vllm.weight_sync=adapter", f"output_dir={tmp_path}"])) == "adapter"
    cfg = compose_cfg(["vllm=colocate", f"output_dir={tmp_path}"])  # LoRA: the runtime's own vLLM engine
    assert grpo_kwargs(cfg, str(tmp_path))["use_vllm"] is False
    # an env with get_tool_functions: TRL's tool loop generates, so TRL's vLLM (on GPUs), never silently HF
    assert grpo_kwargs(cfg, str(tmp_path), tool_functions=True)["use_vllm"] is True


def test_tool_function_env_with_vllm_colocate_is_refused_on_a_cpu(compose_cfg, tmp_path):
    import pytest

    from grpo_pipeline.config.plan import make_plan
    from grpo_pipeline.errors import ConfigError

    class ToolEnv:
        def score_episode(self, model, tokenizer, completion):
            return 0.0

    cfg = compose_cfg(["vllm=colocate", f"output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"vllm=colocate with .*ToolEnv.get_tool_functions: .* Use vllm=off"):
        make_plan(cfg, ToolEnv(), None, None, [lambda city: city], "ToolEnv")


def test_entropy_bonus_and_adaptive_control_map_onto_trl(compose_cfg, tmp_path):
    cfg = compose_cfg(["model=tiny", f"output_dir={tmp_path}"])
    kw = grpo_kwargs(cfg, str(tmp_path), reward_weights=[1.0])
    assert kw["entropy_coef"] == 0.0 and kw["use_adaptive_entropy"] is False  # the default: no bonus
    cfg = compose_cfg(["model=tiny", "loss.entropy_coef=0.01", "loss.entropy_target=0.1",
                       "loss.entropy_coef_delta=0.002", f"output_dir={tmp_path}"])
    args = build_grpo_config(cfg, str(tmp_path), [1.0])
    assert (args.entropy_coef, args.use_adaptive_entropy, args.entropy_target, args.entropy_coef_delta) == (
        0.01, True, 0.1, 0.002)


def test_the_weight_push_hides_only_the_rotary_embeddings_warning():
    import logging

    from grpo_pipeline.rollout.vllm_engine import _no_rotary_warning

    def record(*args):
        return logging.LogRecord("vllm", logging.WARNING, "layerwise.py", 266, "%s: Failed to load weights", args, None)

    assert _no_rotary_warning(record("RotaryEmbedding")) is False  # a computed cos/sin cache: nothing to load
    assert _no_rotary_warning(record("ParallelLMHead")) is True  # a real layer left unloaded still warns


def test_another_trl_minor_fails_at_import_with_the_tested_one_named():
    import subprocess
    import sys

    code = "import trl; trl.__version__ = '1.17.0'; import grpo_pipeline.training.trainer"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "grpo_pipeline needs TRL 1.16.x, and TRL 1.17.0 is installed" in done.stderr
    assert "pip install 'trl>=1.16,<1.17'" in done.stderr
    from grpo_pipeline.training.trainer import check_trl

    check_trl("1.16.3")  # any patch release of the tested minor


def test_trl_1_16_options_map_onto_trl(compose_cfg, tmp_path):
    """TRL 1.16's loss types and options: the presets cite their papers' settings, every key reaches GRPOConfig,
    and use_bias_correction_kl is this project's explicit choice, not TRL's default of the day."""
    luspo = build_grpo_config(compose_cfg(["loss=luspo", f"output_dir={tmp_path}"]), str(tmp_path), [1.0])
    assert (luspo.loss_type, luspo.importance_sampling_level, luspo.epsilon, luspo.epsilon_high, luspo.beta) == (
        "luspo", "sequence", 3e-4, 4e-4, 0.0)
    vespo = build_grpo_config(compose_cfg(["loss=vespo", f"output_dir={tmp_path}"]), str(tmp_path), [1.0])
    assert (vespo.loss_type, vespo.importance_sampling_level, vespo.vespo_k_pos, vespo.vespo_lambda_neg) == (
        "vespo", "token", 2.0, 2.0)
    cfg = compose_cfg(["loss=grpo", "loss.kl_bias_correction=false", "loss.top_entropy_quantile=0.2",
                       "loss.delta=1.5", "loss.off_policy_mask_threshold=0.5", "loss.importance_sampling_level=sequence",
                       "reward=combined", "reward.aggregation=normalize_then_sum", f"output_dir={tmp_path}"])
    args = build_grpo_config(cfg, str(tmp_path), [1.0, 0.2])
    assert args.use_bias_correction_kl is False and args.top_entropy_quantile == 0.2 and args.delta == 1.5
    assert args.off_policy_mask_threshold == 0.5 and args.importance_sampling_level == "sequence"
    assert args.multi_objective_aggregation == "normalize_then_sum"
    default = build_grpo_config(compose_cfg([f"output_dir={tmp_path}"]), str(tmp_path), [1.0])
    assert default.use_bias_correction_kl is True and default.multi_objective_aggregation == "sum_then_normalize"


def test_trl_1_16_options_are_checked_by_name(compose_cfg, tmp_path):
    from grpo_pipeline.config.validate import config_problems

    def problems(*overrides):
        return " ".join(config_problems(compose_cfg([*overrides, f"output_dir={tmp_path}"])))

    assert "loss.top_entropy_quantile=0.0: must be in (0, 1]" in problems("loss.top_entropy_quantile=0")
    assert "loss.delta=1.1: must be > 1 + loss.clip_range=1.2" in problems("loss.delta=1.1")
    assert "loss.loss_type=luspo needs loss.importance_sampling_level=sequence" in problems("loss.loss_type=luspo")
    assert "loss.loss_type=vespo computes its sequence weights itself" in problems(
        "loss=vespo", "loss.importance_sampling_level=sequence")
    assert "reward.aggregation=normalize_then_sum normalises each of several rewards" in problems(
        "reward.aggregation=normalize_then_sum")
    assert problems("loss=luspo") == "" and problems("loss=vespo") == ""
