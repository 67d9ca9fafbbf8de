"""The one place where our config becomes TRL's `GRPOConfig`.

User-facing names map onto TRL's: kl_coef -> beta, clip_range -> epsilon, max_new_tokens ->
max_completion_length, batch_size -> per_device_train_batch_size, num_epochs -> num_train_epochs,
loss.kl_bias_correction -> use_bias_correction_kl, reward.aggregation -> multi_objective_aggregation,
vllm.mode (off|colocate|server) -> use_vllm + vllm_mode; loss.importance_sampling_level, top_entropy_quantile,
delta, off_policy_mask_threshold and vespo_* keep TRL's names.
"""

from typing import Any

import torch
from trl import GRPOConfig

from grpo_pipeline.config.schema import TrainConfig
from grpo_pipeline.config.validate import vllm_in_runtime

# transformers 5.20 renamed TrainingArguments.gradient_checkpointing to activation_checkpointing; the CPU vLLM
# stack (make install-vllm) runs 5.19
CHECKPOINTING = ("activation_checkpointing" if "activation_checkpointing" in GRPOConfig.__dataclass_fields__
                 else "gradient_checkpointing")


def grpo_kwargs(cfg: TrainConfig, output_dir: str, reward_weights: list[float] | None = None,
                tool_functions: bool = False, use_vllm: bool | None = None) -> dict[str, Any]:
    """`use_vllm`: TRL's own vLLM generates (the run plan decides; None: decided here from the config)."""
    gen, loss, train, vllm = cfg.generation, cfg.loss, cfg.training, cfg.vllm
    use_cpu = train.use_cpu if train.use_cpu is not None else not torch.cuda.is_available()
    kwargs: dict[str, Any] = {
        "output_dir": output_dir,
        "seed": cfg.seed,
        # sampling
        "num_generations": gen.num_generations,
        "max_completion_length": gen.max_new_tokens,
        "temperature": gen.temperature,
        "top_k": gen.top_k,
        "top_p": gen.top_p,
        # loss
        "loss_type": loss.loss_type,
        "beta": loss.kl_coef,
        "epsilon": loss.clip_range,
        "epsilon_high": loss.epsilon_high,
        "scale_rewards": loss.scale_rewards,
        "mask_truncated_completions": loss.mask_truncated_completions,
        "num_iterations": loss.num_iterations,
        "entropy_coef": loss.entropy_coef,
        "use_adaptive_entropy": loss.entropy_target is not None,
        "entropy_coef_delta": loss.entropy_coef_delta,
        **({"entropy_target": loss.entropy_target} if loss.entropy_target is not None else {}),
        "use_bias_correction_kl": loss.kl_bias_correction,
        "importance_sampling_level": str(loss.importance_sampling_level),
        "top_entropy_quantile": loss.top_entropy_quantile,
        "delta": loss.delta,
        "off_policy_mask_threshold": loss.off_policy_mask_threshold,
        "vespo_k_pos": loss.vespo_k_pos,
        "vespo_lambda_pos": loss.vespo_lambda_pos,
        "vespo_k_neg": loss.vespo_k_neg,
        "vespo_lambda_neg": loss.vespo_lambda_neg,
        "reward_weights": reward_weights,
        "multi_objective_aggregation": str(cfg.reward.aggregation),
        # optimisation
        "learning_rate": train.learning_rate,
        "lr_scheduler_type": train.lr_scheduler_type,
        "warmup_steps": train.warmup_steps,
        "max_steps": train.max_steps,
        "num_train_epochs": train.num_epochs,
        "per_device_train_batch_size": train.batch_size * gen.oversample,  # dynamic sampling keeps batch_size
        "gradient_accumulation_steps": train.gradient_accumulation_steps,
        "max_grad_norm": train.max_grad_norm,
        "bf16": train.bf16,
        CHECKPOINTING: train.activation_checkpointing,
        "use_cpu": use_cpu,
        # logging and saving: metrics go to MLflow through our own callback (tracking/mlflow_run.py), never through
        # transformers' MLflowCallback (tracking.report_to cannot name mlflow); tensorboard / wandb through
        # transformers' own integrations, pointed at the run dir (tracking/integrations.py)
        "logging_steps": train.logging_steps,
        "logging_nan_inf_filter": False,  # a NaN loss is logged as NaN (DivergenceGuard stops), not averaged away
        "save_strategy": "steps" if train.save_steps > 0 else "no",
        "save_steps": train.save_steps if train.save_steps > 0 else 500,
        "save_total_limit": None,  # checkpoints.CheckpointMarker keeps the last save_total_limit *complete* ones
        "report_to": [str(name) for name in cfg.tracking.report_to] or "none",
        "disable_tqdm": True,  # the progress bar comes from tracking.RunLogger
        "remove_unused_columns": False,  # extra dataset columns are the env's score_episode kwargs
        # generation backend: TRL's vLLM, unless the runtime generates through vLLM itself (vllm_backend.py)
        "use_vllm": (vllm.mode != "off" and not vllm_in_runtime(cfg, tool_functions)) if use_vllm is None else use_vllm,
    }
    if kwargs["use_vllm"]:
        kwargs |= {
            "vllm_mode": vllm.mode,
            "vllm_tensor_parallel_size": vllm.tensor_parallel_size,
            "vllm_gpu_memory_utilization": vllm.gpu_memory_utilization,
            "vllm_server_base_url": vllm.server_base_url,
            "vllm_server_host": vllm.server_host,
            "vllm_server_port": vllm.server_port,
        }
    return kwargs


def build_grpo_config(cfg: TrainConfig, output_dir: str, reward_weights: list[float] | None = None,
                      tool_functions: bool = False, use_vllm: bool | None = None) -> GRPOConfig:
    return GRPOConfig(**grpo_kwargs(cfg, output_dir, reward_weights, tool_functions, use_vllm))
