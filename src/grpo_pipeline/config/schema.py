"""The structured config: one dataclass per group, registered in Hydra's ConfigStore.

`conf/train.yaml` starts from `train_schema`, so every YAML option of every group is merged
onto these dataclasses: a typo in a key or a wrong type fails at compose time, naming the full
key (e.g. `Key 'lerning_rate' not in 'TrainingConfig' full_key: training.lerning_rate`).

The `env` node is the one open node: `_target_` plus the constructor kwargs of the user's env
class. Those kwargs are checked against the class signature at startup (see envs/loader.py).
"""

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


def _choices(name: str, *values: str) -> type[StrEnum]:
    """A closed set of string values for a field. OmegaConf checks it at compose time, naming the key and the
    choices (`Invalid value 'ppo', expected one of [grpo, dr_grpo, ...] full_key: loss.loss_type`); members
    compare equal to their strings (`cfg.loss.loss_type == "dapo"`) and print as them."""
    return StrEnum(name, [(v, v) for v in values], module=__name__)


ModelSource = _choices("ModelSource", "tiny", "hub", "gguf")
DType = _choices("DType", "float32", "bfloat16", "float16")
LossType = _choices("LossType", "grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")  # TRL's
ImportanceSampling = _choices("ImportanceSampling", "token", "sequence")  # TRL's importance_sampling_level
Aggregation = _choices("Aggregation", "sum_then_normalize", "normalize_then_sum")  # multi_objective_aggregation
ScaleRewards = _choices("ScaleRewards", "group", "batch", "none")
VllmMode = _choices("VllmMode", "off", "colocate", "server")
WeightSync = _choices("WeightSync", "weights", "adapter")
OnError = _choices("OnError", "raise", "zero")
ReportTo = _choices("ReportTo", "tensorboard", "wandb")  # transformers' integrations; MLflow is the pipeline's own
EvalReward = _choices("EvalReward", "env", "total")
TurnCredit = _choices("TurnCredit", "episode", "turn")


@dataclass
class ModelConfig:
    # Short label, used in run names.
    name: str = MISSING
    # tiny: random weights + tokenizer built in code | hub: transformers id or local folder |
    # gguf: a GGUF file shipped inside a Python package, converted once to a cached safetensors folder.
    source: ModelSource = ModelSource.hub
    name_or_path: str | None = None
    gguf_package: str | None = None
    gguf_file: str | None = None
    dtype: DType = DType.float32
    # Replace the tokenizer's chat template: a .jinja file, or "trl:<name>" for one TRL ships
    # (e.g. trl:qwen2_5, a ChatML template that renders tools and tool calls).
    chat_template: str | None = None
    # Size of the tiny model (source=tiny only).
    tiny_hidden_size: int = 64
    tiny_num_layers: int = 2


@dataclass
class GenerationConfig:
    # Completions sampled per prompt (the "group" of GRPO).
    num_generations: int = 4
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    # Dynamic sampling (DAPO): sample `oversample` x the step's groups, score them, and train on at most
    # training.batch_size completions from the groups whose rewards differ (a group that scores the same
    # everywhere gives GRPO nothing; it is not trained on). 1: off. One process, no gradient accumulation.
    oversample: int = 1
    # Adaptive sampling for flat groups (Reinforce-Ada): when a step has fewer groups with spread than
    # training.batch_size needs, a flat group that scored below the step's best gets this many more
    # completions of its prompt (a multiple of num_generations); if they differ, the group trains on a balanced
    # num_generations of them, advantages from all. 0: off. One process, no gradient accumulation.
    resample_flat: int = 0
    # Negative sample reinforcement for flat groups (NSR, Zhu et al. 2025): with dynamic sampling, slots the groups
    # with spread leave free go to flat groups that scored below the step's mean, with advantage
    # flat_negative x (reward - mean) / std of the step's rewards: a wrong answer the policy repeats in every
    # sample is pushed down (GRPO's group baseline gives it 0). 0: off. Needs generation.oversample > 1.
    flat_negative: float = 0.0


@dataclass
class LossConfig:
    # TRL's loss_type: grpo | dr_grpo | dapo | bnpo | cispo | sapo | luspo | vespo
    loss_type: LossType = LossType.dapo
    # KL penalty towards the reference model (TRL's beta). 0 skips the reference model.
    kl_coef: float = 0.0
    # PPO-style clip range (TRL's epsilon); epsilon_high defaults to it when null.
    clip_range: float = 0.2
    epsilon_high: float | None = None
    # group | batch | none (Dr. GRPO recommends none).
    scale_rewards: ScaleRewards = ScaleRewards.group
    # Exclude completions cut at max_new_tokens from the loss (DAPO).
    mask_truncated_completions: bool = False
    # Policy updates per generation batch (mu in the paper).
    num_iterations: int = 1
    # Entropy bonus (TRL's entropy_coef): loss - entropy_coef x mean token entropy. With entropy_target set,
    # TRL's adaptive control (Skywork-OR1): the coefficient starts at entropy_coef, rises by entropy_coef_delta
    # each step the entropy is at or below the target, falls otherwise, and applies only at or below it.
    entropy_coef: float = 0.0
    entropy_target: float | None = None
    entropy_coef_delta: float = 0.005
    # The KL term multiplied by the importance ratio, so its gradient is the unbiased reverse-KL one (DeepSeek-V3.2,
    # arXiv:2512.02556; TRL's use_bias_correction_kl). Matters only with kl_coef > 0. True, as TRL 1.16's default
    # and every run measured here; explicit so that another TRL's default cannot change a run.
    kl_bias_correction: bool = True
    # token: a ratio per token (PPO/GRPO); sequence: one ratio per completion, the mean of its tokens' log-ratios
    # (GSPO, arXiv:2507.18071; luspo needs it).
    importance_sampling_level: ImportanceSampling = ImportanceSampling.token
    # Train only on the completions' top share of tokens by entropy (0.2: the 20% highest-entropy "forking"
    # tokens, Wang et al. 2025, arXiv:2506.01939). 1.0: every token.
    top_entropy_quantile: float = 1.0
    # Two-sided clipping: the ratio is also capped at delta (INTELLECT-2, arXiv:2505.07291; > 1 + clip_range).
    delta: float | None = None
    # Off-policy sequence masking: completions with a negative advantage whose mean KL to the sampler exceeds this
    # leave the loss (DeepSeek-V3.2, arXiv:2512.02556, its delta; e.g. 0.5). null: off.
    off_policy_mask_threshold: float | None = None
    # VESPO's Gamma weighting (loss_type=vespo; TRL 1.16's defaults): power k and decay lambda for positive and
    # negative advantages.
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0


@dataclass
class VllmConfig:
    # off | colocate | server
    mode: VllmMode = VllmMode.off
    gpu_memory_utilization: float = 0.3
    tensor_parallel_size: int = 1
    server_base_url: str | None = None
    server_host: str = "0.0.0.0"
    server_port: int = 8000
    # GPUs dedicated to the vLLM server (server mode); the rest train.
    server_gpus: int = 1
    # Longest sequence (prompt + completion, every turn) the runtime's colocated vLLM engine holds.
    max_model_len: int = 2048
    # How the runtime's colocated engine gets the policy before each rollout: weights (loaded in place, LoRA
    # merged) | adapter (LoRA only: a LoRARequest). null: adapter for LoRA on GPUs, weights otherwise.
    weight_sync: WeightSync | None = None


@dataclass
class LoraConfig:
    enabled: bool = False
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    # null: PEFT's all-linear (every linear layer but the output head; models.lora_target_modules).
    target_modules: list[str] | None = None
    # Also write merged full weights next to the adapter.
    save_merged: bool = False


@dataclass
class RewardConfig:
    # Weight of the env's score_episode score; 0 drops it.
    env_weight: float = 1.0
    # name -> {_target_: a reward callable, weight: float, **kwargs}
    components: dict[str, Any] = field(default_factory=dict)
    # How several rewards become one advantage (TRL's multi_objective_aggregation): sum_then_normalize (the weighted
    # sum, normalised per group) or normalize_then_sum (each reward normalised per group first, then the weighted
    # sum normalised over the batch: GDPO, arXiv:2601.05242, so a reward with a wide range cannot drown the others).
    aggregation: Aggregation = Aggregation.sum_then_normalize


@dataclass
class NoSignalConfig:
    # Stop a run that cannot learn, with a checkpoint and a diagnosis: when at least flat_share of the groups of the
    # last `patience` steps (or of the last min_groups groups, when those steps hold fewer) had no reward spread, or
    # when the policy's mean token entropy stayed below min_entropy for `patience` steps (0: not checked).
    enabled: bool = True
    flat_share: float = 0.95
    patience: int = 20
    min_groups: int = 40
    min_entropy: float = 0.0


@dataclass
class TrainingConfig:
    # null: the plan chooses from the model and the fine-tuning mode (config/plan.py, recipe_choices): what a
    # conf/recipe/<model>_<lora>.yaml tuned, else LoRA 1e-4 / full fine-tuning 1e-5.
    learning_rate: float | None = None
    lr_scheduler_type: str = "constant"
    # An int >= 1 is a number of steps; a float < 1 a share of all steps.
    warmup_steps: float = 0.0
    # -1: run num_epochs over the training split. null: 50 steps, or num_epochs's epochs when that is set.
    max_steps: int | None = None
    num_epochs: float | None = None
    # Completions per device per optimizer step (TRL's per_device_train_batch_size).
    batch_size: int = 8
    gradient_accumulation_steps: int = 1
    max_grad_norm: float = 1.0
    logging_steps: int = 1
    # Checkpoint every N steps (0: none); keep the last save_total_limit.
    save_steps: int = 0
    save_total_limit: int = 2
    bf16: bool = False
    # Recompute activations in the backward pass: saves memory on big models, costs time (TRL's default
    # is true; small models on CPU train faster without).
    activation_checkpointing: bool = False
    # Loss forward: run the prompt prefix every sequence of a batch shares (system prompt, worked example)
    # once, with gradients, instead of once per sequence. Exact (tested against TRL's path); ~3x cheaper loss
    # on the default run. Single process, text-only, no activation checkpointing; else TRL's own path.
    shared_prefix_loss: bool = True
    # null: CPU when no GPU is present.
    use_cpu: bool | None = None
    # Save the trained weights / adapter to <run dir>/model.
    save_model: bool = True
    # Stop training after this many minutes (a normal end, checked after each step); null: no time limit.
    max_minutes: float | None = None
    no_signal: NoSignalConfig = field(default_factory=NoSignalConfig)


@dataclass
class RuntimeConfig:
    # Episodes scored at once (threads). 1 scores one after another.
    max_concurrency: int = 8
    # Seconds one score_episode call may take; a slower one counts as a timeout.
    episode_timeout_s: float = 120.0
    # Merge the model.generate calls of concurrent episodes into one batched call.
    batch_generate: bool = True
    # How long a queued generate call waits for other episodes' calls before running anyway.
    batch_wait_ms: float = 20.0
    # The most new tokens one model.generate call of an env may ask for: larger max_new_tokens (or a model's
    # max_length that leaves more) are cut to this, with a warning. Bounds how long an env's call can hold the run.
    max_call_tokens: int = 1024
    # An env's model call still running this many seconds after its batch ended (its episode abandoned) stops
    # the run with the call named: the trainer cannot update the weights under it.
    call_deadline_s: float = 300.0
    # raise: stop on the first env error or timeout | zero: score it 0 (no advantage in its group), count it.
    on_error: OnError = OnError.zero
    # on_error=zero stops the run when more than this share of the last failure_window training episodes
    # failed or timed out (0.1 over 200: more than 20). Every episode of the first 2 batches failing stops it too.
    max_failure_rate: float = 0.1
    failure_window: int = 200
    # Multi-turn envs (those with a `respond` method): the runtime generates every assistant turn. An episode
    # ends when respond returns None, after max_turns assistant turns (an env's own `max_turns` attribute
    # wins), or when its completion (assistant + env tokens) would pass max_episode_tokens. Each assistant
    # turn gets generation.max_new_tokens (an env's `turn_max_new_tokens` attribute wins).
    max_turns: int = 4
    max_episode_tokens: int = 1024
    # Generate from a merged copy of a LoRA policy (plain layers holding W + BA, refreshed before every
    # rollout): no per-token adapter overhead while decoding, at the cost of one copy of the model's memory.
    # null: on when the model runs on the CPU.
    merged_generation: bool | None = None
    # dtype of that copy: float32 | bfloat16 | float16. A copy in another dtype than the trainer's samples from
    # a slightly different distribution; the loss then takes the sampled tokens' log-probs as the behaviour
    # policy's (PPO's ratio against what really sampled; TRL's clip_ratio/* and sampling/* metrics show the gap).
    # null: bfloat16 for a single-turn env's float32 model on a CPU with native bf16 (AVX512-BF16/AMX), else the
    # model's own (multi-turn: measured slower in bf16).
    generation_dtype: DType | None = None
    # Hold a float32 merged copy's linear weights prepacked for oneDNN's matmul (repacked at every refresh): a CPU
    # decode step reads the weights ~2x faster on some CPUs (docs/performance.md). null: on for a float32 copy on a
    # CPU whose torch has oneDNN where a start-up measurement finds it >= 1.1x faster (config/machine.py); a bf16
    # copy keeps torch's own matmul (not measured packed).
    packed_generation: bool | None = None
    # An env that calls model.generate inside score_episode (the documents' style: turn 2 onwards generated by the
    # env): in training, what those calls sample with the run's sampling settings is recorded and trained, each call
    # a row of its own with its episode's advantage. Calls that sample otherwise (greedy, their own temperature or
    # logits processors) are not trained, and counted (env/turn_samples_skipped). false: only the first reply trains.
    train_env_calls: bool = True
    # How the turns of a multi-turn (`respond`) episode share credit. episode: every turn gets the episode's
    # advantage (GRPO's). turn: each assistant turn its own, from the env's optional score_turn(messages, **row)
    # after the turn and the episode's reward, against the other episodes of its group that reached that turn
    # (training/turn_credit.py says why this stays unbiased when the policy decides how many turns it takes).
    turn_credit: TurnCredit = TurnCredit.episode


@dataclass
class LedgerConfig:
    # Every episode (training and held-out) to <run dir>/episodes.jsonl, and at the end to MLflow as a table.
    enabled: bool = True
    # Training episodes recorded per step (a seeded sample beyond this); held-out ones are all recorded.
    max_per_step: int = 64
    # Prompt and completion texts are cut to this many characters (a prompt keeps its end).
    max_chars: int = 4000
    # Rows of the MLflow table (held-out episodes first, then a sample of the training ones).
    mlflow_max_rows: int = 5000


@dataclass
class EvalConfig:
    # Held-out evaluation. Unique prompts of the env's dataset are split three ways: a test set (scored only
    # before and after training: the number to report), a validation set (scored every `every_steps` during
    # training; it picks the best model) and the rest, which is trained on. No prompt is on two sides.
    enabled: bool = False
    # Test prompts. null: 10% of the unique prompts, at most 200; a set under 5 prompts is not held out.
    num_prompts: int | None = None
    # Validation prompts. null: 10% of the unique prompts, at most 32, held out only with every_steps > 0.
    val_prompts: int | None = None
    # Score the validation set every N training steps (0: never).
    every_steps: int = 0
    # With every_steps > 0: model/ holds the weights of the best validation step if it beat the last step by
    # more than best_margin paired standard errors over the validation prompts, else the last step's;
    # model-last/ always the last ones. false: model/ is the last step's.
    keep_best: bool = True
    # The highest of several noisy validation scores is partly luck: on the default run the best-scored step's
    # weights scored below the last step's on the test set for each of 5 seeds (docs/results.md). 0: the
    # best-scored step whenever it scored above the last.
    best_margin: float = 2.0
    # Stop training after this many validations without improvement (0: never stop early).
    early_stop_patience: int = 0
    # The split's seed: fixed, so runs with different training seeds share one held-out set.
    split_seed: int = 0
    batch_size: int = 16
    # null: generation.max_new_tokens.
    max_new_tokens: int | None = None
    # What a held-out episode scores: env (the env's score_episode alone) | total (the reward training sums:
    # reward.env_weight x the env's score + each reward.components entry x its weight; success = every part full).
    reward: EvalReward = EvalReward.env
    before: bool = True
    after: bool = True


@dataclass
class CheckConfig:
    # The env doctor (python -m grpo_pipeline check): num_prompts prompts, each answered max(num_generations)
    # times; the share of flat groups (no reward spread) is estimated for every group size listed.
    num_prompts: int = 4
    num_generations: list[int] = field(default_factory=lambda: [2, 4, 8])
    # Score degenerate completions (empty, echo, tag with a random value, repetition, half an answer) and
    # a second scoring of the same completions: flags exploitable and nondeterministic rewards.
    probes: bool = True
    # Slower mean episodes than this get a warning.
    slow_episode_s: float = 5.0


@dataclass
class TrackingConfig:
    enabled: bool = True
    # null: sqlite:///<launch dir>/outputs/mlflow.db
    tracking_uri: str | None = None
    experiment_name: str = "grpo_pipeline"
    run_name: str | None = None
    # Metrics are written from a background thread every flush_every_s seconds (and at checkpoints and
    # the end); training never waits on the store.
    flush_every_s: float = 5.0
    # A store that fails every write (server restart, sqlite lock) is retried with backoff; only after
    # this many seconds does the run stop, with a checkpoint saved and the resume command printed.
    outage_grace_s: float = 600.0
    # Config keys (globs, e.g. "env.*_url") whose values are secrets, besides those whose names contain key, token,
    # secret, password, passwd or credential; and ${oc.env:...} values. Masked in everything written (tracking/redact.py).
    secret_keys: list[str] = field(default_factory=list)
    # Also log the training metrics through transformers' own integrations (TrainingArguments.report_to):
    # tensorboard (event files in <run dir>/tensorboard) and/or wandb (offline unless WANDB_MODE says otherwise,
    # files in <run dir>/wandb). MLflow is always the run's store and is not listed here.
    report_to: list[ReportTo] = field(default_factory=list)


@dataclass
class SentinelConfig:
    # Checks that the sampler samples the policy being trained (rollout/sentinel.py). Before each training rollout
    # the runtime's merged copy is probed against the policy; a copy that does not hold its weights stops the run.
    enabled: bool = True
    # The copy is probed at the first training rollout and then every every_steps steps (a probe costs two forwards).
    every_steps: int = 10
    # The sampler's vs the trainer's log-probs on the tokens trained (sentinel/logp_gap_max, in nats): warn past
    # logp_gap_warn (healthy bf16-copy runs peak near 0.9), stop past logp_gap_stop for `patience` steps in a row.
    logp_gap_warn: float = 2.0
    logp_gap_stop: float = 5.0
    patience: int = 3


@dataclass
class TrainConfig:
    model: ModelConfig = MISSING
    env: dict[str, Any] = MISSING
    loss: LossConfig = MISSING
    vllm: VllmConfig = MISSING
    lora: LoraConfig = MISSING
    reward: RewardConfig = MISSING
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    check: CheckConfig = field(default_factory=CheckConfig)
    ledger: LedgerConfig = field(default_factory=LedgerConfig)
    sentinel: SentinelConfig = field(default_factory=SentinelConfig)
    seed: int = 42
    # Set by conf/recipe/<model>_<lora>.yaml (what was tuned for that model and mode); null: none applies.
    recipe: str | None = None
    # Where this job writes (Hydra's run dir by default).
    output_dir: str = MISSING
    # null: a new run | auto: continue output_dir from its latest checkpoint, if any |
    # <run dir>: continue that earlier run (same MLflow run) from its latest checkpoint, with its own config
    # (the overrides it was started with, then this command's; see training/run_dir.py).
    resume: str | None = None
    # Keys (globs) a resume may change although they change what a step computes, e.g. [loss.kl_coef]; each
    # change is recorded with its step. Safe keys (training.max_steps, ...) need no opt-in.
    resume_allow: list[str] = field(default_factory=list)


def launch_time(pattern: str) -> str:
    """Hydra's ${now:...} for the run dir, but one time for every process of a run: processes that a launcher
    started (torchrun / accelerate launch set LOCAL_RANK) take the launcher's start time, so ranks started a
    second apart still compose the same run dir. On several machines set hydra.run.dir yourself."""
    import datetime
    import os

    started = None
    if "LOCAL_RANK" in os.environ:
        import psutil

        try:
            started = psutil.Process(os.getppid()).create_time()
        except psutil.Error:
            started = None
    when = datetime.datetime.fromtimestamp(started) if started else datetime.datetime.now()
    return when.strftime(pattern)


def register_configs() -> None:
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    OmegaConf.register_new_resolver("launch_time", launch_time, use_cache=True, replace=True)
