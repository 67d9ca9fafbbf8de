"""Checks on the composed config that the schema's types cannot express. All problems are reported at
once, each naming the key, the value and the fix; nothing here loads weights. A field's closed set of
values (loss.loss_type, vllm.mode, ...) is an Enum in the schema: OmegaConf refuses others at compose time."""

import importlib.util
import os

from grpo_pipeline.config.schema import TrainConfig
from grpo_pipeline.errors import ConfigError


def config_problems(cfg: TrainConfig) -> list[str]:
    p: list[str] = []
    world = int(os.environ.get("WORLD_SIZE", "1"))  # training processes (accelerate launch sets it)
    gen, loss, train, run = cfg.generation, cfg.loss, cfg.training, cfg.runtime

    if cfg.model.source == "hub" and not cfg.model.name_or_path:
        p.append("model.name_or_path is empty: set a hub id or a local folder (model.source=hub).")
    if cfg.model.source == "gguf" and not (cfg.model.gguf_package and cfg.model.gguf_file):
        p.append("model.gguf_package and model.gguf_file must both be set (model.source=gguf).")

    if gen.num_generations < 2:
        p.append(f"generation.num_generations={gen.num_generations}: GRPO compares >= 2 completions per prompt.")
    if gen.max_new_tokens < 1:
        p.append(f"generation.max_new_tokens={gen.max_new_tokens}: must be >= 1.")
    if gen.temperature <= 0:
        p.append(f"generation.temperature={gen.temperature}: must be > 0 (GRPO needs sampling).")
    if not 0 < gen.top_p <= 1:
        p.append(f"generation.top_p={gen.top_p}: must be in (0, 1].")
    if gen.top_k < 0:
        p.append(f"generation.top_k={gen.top_k}: must be >= 0 (0 disables it).")
    if gen.oversample < 1:
        p.append(f"generation.oversample={gen.oversample}: must be >= 1 (1 turns dynamic sampling off).")
    if gen.resample_flat < 0 or (gen.num_generations > 0 and gen.resample_flat % gen.num_generations):
        p.append(f"generation.resample_flat={gen.resample_flat}: must be 0 (off) or a multiple of "
                 f"generation.num_generations={gen.num_generations} (the extra completions are scored in groups).")
    if cfg.eval.best_margin < 0:
        p.append(f"eval.best_margin={cfg.eval.best_margin}: must be >= 0 (standard errors; 0 keeps the best-scored "
                 "validation step whenever it scored above the last).")
    if gen.flat_negative < 0:
        p.append(f"generation.flat_negative={gen.flat_negative}: must be >= 0 (0 turns it off).")
    elif gen.flat_negative and gen.oversample <= 1:
        p.append(f"generation.flat_negative={gen.flat_negative} fills the slots dynamic sampling leaves free: it "
                 "needs generation.oversample > 1 (e.g. 2).")

    if loss.kl_coef < 0:
        p.append(f"loss.kl_coef={loss.kl_coef}: must be >= 0.")
    if loss.clip_range <= 0:
        p.append(f"loss.clip_range={loss.clip_range}: must be > 0.")
    if loss.epsilon_high is not None and loss.epsilon_high < loss.clip_range:
        p.append(
            f"loss.epsilon_high={loss.epsilon_high} < loss.clip_range={loss.clip_range}: the upper clip must be "
            "at least the lower one; raise loss.epsilon_high or set it to null."
        )
    if loss.num_iterations < 1:
        p.append(f"loss.num_iterations={loss.num_iterations}: must be >= 1.")
    if loss.entropy_coef < 0 or loss.entropy_coef_delta < 0:
        p.append(f"loss.entropy_coef={loss.entropy_coef}, loss.entropy_coef_delta={loss.entropy_coef_delta}: must be "
                 ">= 0 (a bonus for entropy; 0 turns it off).")
    if not 0 < loss.top_entropy_quantile <= 1:
        p.append(f"loss.top_entropy_quantile={loss.top_entropy_quantile}: must be in (0, 1] (the share of tokens "
                 "trained, by entropy; 1.0 trains every token).")
    if loss.delta is not None and loss.delta <= 1 + loss.clip_range:
        p.append(f"loss.delta={loss.delta}: must be > 1 + loss.clip_range={1 + loss.clip_range:g} (an upper cap on "
                 "the ratio, above the clip), or null.")
    if loss.off_policy_mask_threshold is not None and loss.off_policy_mask_threshold <= 0:
        p.append(f"loss.off_policy_mask_threshold={loss.off_policy_mask_threshold}: must be > 0 (e.g. 0.5), or null.")
    if loss.loss_type == "luspo" and loss.importance_sampling_level != "sequence":
        p.append("loss.loss_type=luspo needs loss.importance_sampling_level=sequence (LUSPO is GSPO with a length "
                 "scaling): use loss=luspo.")
    if loss.loss_type == "vespo" and loss.importance_sampling_level != "token":
        p.append("loss.loss_type=vespo computes its sequence weights itself: set loss.importance_sampling_level=token.")
    if cfg.reward.aggregation == "normalize_then_sum" and not cfg.reward.components:
        p.append("reward.aggregation=normalize_then_sum normalises each of several rewards: with the env's score "
                 "alone it is sum_then_normalize with a batch-level scale. Use reward=combined, or leave it.")
    if loss.entropy_target is not None and loss.entropy_target <= 0:
        p.append(f"loss.entropy_target={loss.entropy_target}: must be > 0 (mean token entropy in nats), or null.")

    if train.learning_rate is not None and train.learning_rate <= 0:
        p.append(f"training.learning_rate={train.learning_rate}: must be > 0.")
    if train.batch_size < 1 or train.gradient_accumulation_steps < 1:
        p.append("training.batch_size and training.gradient_accumulation_steps must be >= 1.")
    else:
        per_step = train.batch_size * train.gradient_accumulation_steps * world
        if per_step % max(gen.num_generations, 1):
            p.append(
                f"training.batch_size={train.batch_size} x gradient_accumulation_steps="
                f"{train.gradient_accumulation_steps} x {world} process(es) = {per_step} completions per step, "
                f"which generation.num_generations={gen.num_generations} does not divide. Make batch_size a "
                "multiple of num_generations (each prompt's group must fit in one step)."
            )
    if train.max_steps == 0 or (train.num_epochs is not None and train.num_epochs <= 0):
        p.append("training.max_steps (or training.num_epochs when max_steps=-1) must be > 0.")
    if train.logging_steps < 1:
        p.append(f"training.logging_steps={train.logging_steps}: must be >= 1 (metrics every N steps; 1 logs each).")
    if train.max_minutes is not None and train.max_minutes <= 0:
        p.append(f"training.max_minutes={train.max_minutes}: must be > 0, or null (no time limit).")
    tracking = cfg.tracking
    if tracking.flush_every_s <= 0:
        p.append(f"tracking.flush_every_s={tracking.flush_every_s}: must be > 0 (seconds between the background "
                 "writer's flushes; e.g. 5).")
    if tracking.outage_grace_s < 0:
        p.append(f"tracking.outage_grace_s={tracking.outage_grace_s}: must be >= 0 (seconds a failing store is "
                 "retried before the run stops with a checkpoint).")
    p += _report_to_problems(tracking.report_to)

    if run.max_concurrency < 1:
        p.append(f"runtime.max_concurrency={run.max_concurrency}: must be >= 1.")
    if run.max_turns < 1 or run.max_episode_tokens < 2:
        p.append(f"runtime.max_turns={run.max_turns} must be >= 1 and runtime.max_episode_tokens="
                 f"{run.max_episode_tokens} >= 2.")
    if run.max_call_tokens < 1 or run.call_deadline_s <= 0:
        p.append(f"runtime.max_call_tokens={run.max_call_tokens} must be >= 1 and runtime.call_deadline_s="
                 f"{run.call_deadline_s} > 0.")
    if run.episode_timeout_s <= 0:
        p.append(f"runtime.episode_timeout_s={run.episode_timeout_s}: must be > 0.")
    if not 0 <= run.max_failure_rate <= 1:
        p.append(f"runtime.max_failure_rate={run.max_failure_rate}: must be in [0, 1] (a share of "
                 "runtime.failure_window episodes; 1 never stops for failures).")
    if run.failure_window < 1:
        p.append(f"runtime.failure_window={run.failure_window}: must be >= 1 (episodes).")

    ev = cfg.eval
    if ev.enabled:
        for key in ("num_prompts", "val_prompts"):
            if getattr(ev, key) is not None and getattr(ev, key) < 1:
                p.append(f"eval.{key}={getattr(ev, key)}: must be >= 1 (or null: chosen from the dataset's size).")
        if ev.batch_size < 1 or ev.every_steps < 0 or ev.early_stop_patience < 0:
            p.append("eval.batch_size must be >= 1, eval.every_steps and eval.early_stop_patience >= 0.")
        if ev.early_stop_patience and not ev.every_steps:
            p.append(f"eval.early_stop_patience={ev.early_stop_patience} needs validation during training: "
                     "set eval.every_steps > 0.")
    if cfg.reward.env_weight < 0:
        p.append(f"reward.env_weight={cfg.reward.env_weight}: must be >= 0.")
    if cfg.reward.env_weight == 0 and not cfg.reward.components:
        p.append("reward: env_weight=0 and no components: there is nothing to reward. Pick reward=env.")

    p += _vllm_problems(cfg, world)
    p += _sharding_problems(os.environ)
    return p


# tracking.report_to -> the package transformers' integration needs (it checks these names the same way)
_REPORT_TO_PACKAGES = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",)}


def _report_to_problems(report_to) -> list[str]:
    return [f"tracking.report_to={[str(x) for x in report_to]}: {name} is not installed. Install it "
            f"(pip install {_REPORT_TO_PACKAGES[name][0]}), or remove {name} from tracking.report_to."
            for name in dict.fromkeys(str(x) for x in report_to)
            if not any(importlib.util.find_spec(m) for m in _REPORT_TO_PACKAGES[name])]


def _sharding_problems(environ) -> list[str]:
    """accelerate's DeepSpeed ZeRO-3 and FSDP shard the parameters: every forward is then a collective that all
    processes must enter together. The runtime's decode loop stops per process at eos, held-out evaluation runs
    on the main process only and the main process saves more often than the others: under sharding each of
    these would hang the run. Refused until those loops are collective-safe."""
    why = ("shards the parameters across processes, and the pipeline's own model loops (the runtime's decode loop "
           "stopping per process at eos, held-out evaluation on the main process only, the main process's extra "
           "saves) are not collective-safe: the run would hang at its first uneven forward. Use DDP (accelerate "
           "launch --num_processes N, no --config_file) or DeepSpeed ZeRO-2 (accelerate/deepspeed_zero2.yaml), "
           "which keep whole parameters on every process.")
    if environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        return [f"FSDP (accelerate's ACCELERATE_USE_FSDP) {why}"]
    if environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() not in ("1", "true"):
        return []
    stage = environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    config_file = environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if stage is None and config_file:  # a DeepSpeed JSON file names the stage itself
        import json

        try:
            stage = str(json.loads(open(config_file).read()).get("zero_optimization", {}).get("stage"))
        except (OSError, ValueError, AttributeError):
            stage = None
    return [f"DeepSpeed ZeRO-3 (ACCELERATE_DEEPSPEED_ZERO_STAGE=3) {why}"] if stage == "3" else []


def _vllm_problems(cfg: TrainConfig, world: int) -> list[str]:
    vllm = cfg.vllm
    if vllm.mode == "off":
        return [] if vllm.weight_sync is None else [
            f"vllm.weight_sync={vllm.weight_sync} with vllm=off: it says how vLLM gets the policy, and no vLLM runs. "
            "Use vllm=colocate, or drop vllm.weight_sync."]
    import torch  # here, not at the top: a config error must print before torch loads

    p = []
    gpu = torch.cuda.is_available()
    if importlib.util.find_spec("vllm") is None:
        p.append(f"vllm={vllm.mode} needs the vllm package: on a CPU machine `make install-vllm` installs its CPU "
                 "build into .venv-vllm (run from there); on GPUs pip install '.[vllm]'.")
    if vllm.mode == "server" and not gpu:
        p.append("vllm=server needs GPUs: TRL's vLLM server takes the trainer's weights over NCCL, which needs CUDA. "
                 "On a CPU use vllm=colocate, or vllm=off.")
    in_runtime = vllm_in_runtime(cfg)
    if in_runtime and world > 1:
        p.append(f"vllm=colocate {'with LoRA' if gpu else 'on a CPU'} runs vLLM inside the one training process; "
                 f"{world} processes were started. Use one process, or vllm=server.")
    if vllm.weight_sync is not None and not in_runtime:
        p.append(f"vllm.weight_sync={vllm.weight_sync} is for the runtime's colocated engine (vllm=colocate with LoRA, "
                 f"or any vllm=colocate on a CPU); vllm={vllm.mode}{' with lora=off on GPUs' if vllm.mode == 'colocate' else ''} "
                 "goes through TRL's vLLM, which pushes the weights itself: drop vllm.weight_sync.")
    elif vllm.weight_sync == "adapter" and not cfg.lora.enabled:
        p.append("vllm.weight_sync=adapter hands vLLM a LoRA adapter, and lora=off trains none: use "
                 "vllm.weight_sync=weights (or null), or lora=default.")
    if vllm.mode == "colocate" and cfg.model.source == "tiny":
        p.append("vllm=colocate with model=tiny: vLLM loads a model folder, and the tiny model is built in code. "
                 "Use model=smollm2_135m (or a hub model), or vllm=off.")
    if vllm.max_model_len < 16:
        p.append(f"vllm.max_model_len={vllm.max_model_len}: must be >= 16.")
    if not 0 < vllm.gpu_memory_utilization <= 1:
        p.append(f"vllm.gpu_memory_utilization={vllm.gpu_memory_utilization}: must be in (0, 1].")
    if vllm.tensor_parallel_size < 1:
        p.append(f"vllm.tensor_parallel_size={vllm.tensor_parallel_size}: must be >= 1.")
    elif vllm.mode == "colocate" and world % vllm.tensor_parallel_size:
        p.append(f"vllm.tensor_parallel_size={vllm.tensor_parallel_size} does not divide the {world} training "
                 "process(es); colocated vLLM shards each model over tensor_parallel_size of them.")
    return p


def vllm_in_runtime(cfg, tool_functions: bool = False) -> bool:
    """vLLM generates inside the runtime (this module) rather than inside TRL: colocated, with a LoRA policy or on a
    CPU (where TRL's weight push fails). TRL's own vLLM path stays for `vllm=server`, for full fine-tuning on GPUs,
    and for envs with `get_tool_functions` (TRL's tool loop generates those episodes)."""
    import torch

    return (cfg.vllm.mode == "colocate" and not tool_functions
            and (bool(cfg.lora.enabled) or not torch.cuda.is_available()))


def weight_sync(cfg) -> str:
    """vllm.weight_sync, with null resolved: `weights` without LoRA or on a CPU (docs/results.md: vLLM's CPU LoRA
    kernels cost more per token than a weight push costs per step), `adapter` for LoRA on GPUs."""
    import torch

    if cfg.vllm.weight_sync is not None:
        return cfg.vllm.weight_sync
    return "adapter" if cfg.lora.enabled and torch.cuda.is_available() else "weights"


def check_config(cfg: TrainConfig) -> None:
    from omegaconf import OmegaConf

    missing = [k for k in OmegaConf.missing_keys(cfg) if not k.startswith("env.")]
    if missing:
        raise ConfigError(f"Required config value(s) not set: {', '.join(sorted(missing))}. "
                          "Set them on the command line (key=value) or in your config.")
    problems = config_problems(cfg)
    if problems:
        raise ConfigError("Invalid config:\n" + "\n".join(f"  - {x}" for x in problems))


def fit_step(cfg: TrainConfig, rows: int, env_name: str) -> tuple[dict, str | None]:
    """The step's shape fitted to where it runs and to the data, and what was chosen (None: nothing changed);
    `cfg` is not changed (the run plan applies the shape to a copy). Dynamic sampling picks whole groups on one
    process, so it is off with several processes or gradient accumulation (a group may span them). A step
    samples batch_size x oversample / num_generations prompts; an env with fewer training rows would never fill
    one step (TRL then trains nothing): the step shrinks to the data, dynamic sampling first."""
    gen, train = cfg.generation, cfg.training
    batch_size, oversample = train.batch_size, gen.oversample
    resample_flat, flat_negative = gen.resample_flat, gen.flat_negative
    world = int(os.environ.get("WORLD_SIZE", "1"))
    said = []
    if (oversample > 1 or resample_flat) and (world > 1 or train.gradient_accumulation_steps > 1):
        oversample, resample_flat, flat_negative = 1, 0, 0.0
        said.append(f"generation.oversample, resample_flat and flat_negative (dynamic sampling) run on one process "
                    f"without gradient accumulation; with {world} process(es) and training.gradient_accumulation_steps="
                    f"{train.gradient_accumulation_steps} they are off (generation.oversample=1, resample_flat=0, "
                    "flat_negative=0).")
    ga = train.gradient_accumulation_steps
    batches = world * ga  # per-process batches one generation fills (TRL: steps_per_generation = GA)
    asked = batch_size * oversample * batches // gen.num_generations  # prompts per generation
    if 1 <= rows < asked:
        before = f"training.batch_size={batch_size}, generation.oversample={oversample}"
        oversample = max(1, min(oversample, rows * gen.num_generations // (batch_size * batches)))
        if rows * gen.num_generations < batch_size * oversample * batches:
            batch_size = max(gen.num_generations, rows // batches * gen.num_generations)
        now = batch_size * oversample * batches // gen.num_generations
        where = (f" over {world} process(es) x training.gradient_accumulation_steps={ga}" if batches > 1 else "")
        if now > rows:
            raise ConfigError(f"{env_name} has {rows} training prompt(s), fewer than one generation needs: "
                              f"{now} ({world} process(es) x training.gradient_accumulation_steps={ga} x one group "
                              f"of generation.num_generations={gen.num_generations}). Lower "
                              "training.gradient_accumulation_steps or the number of processes, or give the env "
                              "more rows.")
        said.append(f"{env_name} has {rows} training prompt(s) but a step samples {asked} ({before}, "
                    f"generation.num_generations={gen.num_generations}{where}): using training.batch_size="
                    f"{batch_size}, generation.oversample={oversample} ({now} prompt(s) a step{where}). "
                    "Set them yourself to choose.")
    step = {"training.batch_size": batch_size, "generation.oversample": oversample,
            "generation.resample_flat": resample_flat, "generation.flat_negative": flat_negative}
    return step, " ".join(said) or None
