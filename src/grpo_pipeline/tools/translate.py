"""Translate the flags of other GRPO CLIs into our Hydra overrides.

    grpo-pipeline translate -- --trainer grpo --rl-env-module my_envs.hotel_env --rl-env-class HotelEnv \\
        --rl-env-config '{"max_turns": 5}' --rl-num-generations 4 --peft --lora-r 16
    grpo-pipeline translate --run -- <flags>      # print, then run them

Every flag of that family is translated or rejected by name with the reason. A flag not given takes the value
it has in those documents (DOCUMENTED_DEFAULTS: loss grpo, lr 1e-5, 128 new tokens, top_k 50, kl 0.1, one epoch,
batch 4, no dynamic sampling), so a translated command means what it meant there, not this project's recipe.
`--rl-loss-type X` sets the loss type alone; `--loss-preset` (this translator's own flag) takes conf/loss/X.yaml
whole (DAPO's clip-higher, no KL, masked truncation...).
"""

import argparse
import json
import shlex
import subprocess
import sys

from grpo_pipeline.config.schema import LossType
from grpo_pipeline.errors import ConfigError

# flag -> (our key, type); the simple one-to-one ones.
VALUE_FLAGS = {
    "--rl-num-generations": ("generation.num_generations", int),
    "--rl-max-new-tokens": ("generation.max_new_tokens", int),
    "--rl-temperature": ("generation.temperature", float),
    "--rl-top-k": ("generation.top_k", int),
    "--rl-top-p": ("generation.top_p", float),
    "--rl-kl-coef": ("loss.kl_coef", float),
    "--rl-clip-range": ("loss.clip_range", float),
    "--lr": ("training.learning_rate", float),
    "--epochs": ("training.num_epochs", float),
    "--batch-size": ("training.batch_size", int),
    "--lora-r": ("lora.r", int),
    "--lora-alpha": ("lora.alpha", int),
    "--lora-dropout": ("lora.dropout", float),
    "--vllm-gpu-memory-utilization": ("vllm.gpu_memory_utilization", float),
    "--vllm-server-url": ("vllm.server_base_url", str),
    "--vllm-server-gpus": ("vllm.server_gpus", int),
    "--vllm-tensor-parallel-size": ("vllm.tensor_parallel_size", int),
}
# What a flag means when it is not given, in the documents those CLIs come from (their parameter tables and
# Python API): our key -> value. Set explicitly so that neither train.yaml's recipe nor conf/tuned/ applies.
DOCUMENTED_DEFAULTS = {
    "generation.num_generations": 4,
    "generation.max_new_tokens": 128,
    "generation.temperature": 1.0,
    "generation.top_k": 50,
    "generation.top_p": 1.0,
    "generation.oversample": 1,  # no dynamic sampling
    "loss.kl_coef": 0.1,
    "loss.clip_range": 0.2,
    "loss.mask_truncated_completions": False,
    "training.learning_rate": 1e-5,
    "training.num_epochs": 1.0,
    "training.batch_size": 4,
}
# What this project does on top, and how to turn it off (printed with the translation).
ADDED_BEHAVIOURS = (
    "a held-out split (10% of the prompts, at most 200 test + 32 validation) scored before and after training, "
    "and validation every eval.every_steps choosing model/: eval.enabled=false turns both off",
    "the episode ledger (every completion with its reward, <run dir>/episodes.jsonl): ledger.enabled=false",
    "MLflow tracking (outputs/mlflow.db): tracking.enabled=false",
)
REJECTED = {
    "--data-path": "GRPO envs own their data: build_dataset(tokenizer) makes the dataset; drop the flag.",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grpo-pipeline translate", add_help=False)
    p.add_argument("task", nargs="?")  # `aitraining llm --train ...`: the positional task
    p.add_argument("--train", action="store_true")
    p.add_argument("--project-name")
    p.add_argument("--loss-preset", action="store_true")
    p.add_argument("--trainer")
    p.add_argument("--model")
    p.add_argument("--rl-env-module")
    p.add_argument("--rl-env-class")
    p.add_argument("--rl-env-config")
    p.add_argument("--rl-loss-type")
    p.add_argument("--rl-mask-truncated-completions", action="store_true")
    p.add_argument("--use-vllm", action="store_true")
    p.add_argument("--vllm-mode")
    p.add_argument("--peft", action="store_true")
    for flag, (_, kind) in VALUE_FLAGS.items():
        p.add_argument(flag, type=kind)
    for flag in REJECTED:
        p.add_argument(flag)
    return p


def _value(v) -> str:
    """A JSON value as a Hydra override value."""
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, bool):
        return str(v).lower()
    if v is None:
        return "null"
    if isinstance(v, list):
        return "[" + ",".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_value(x)}" for k, x in v.items()) + "}"
    return repr(v)


def translate(flags: list[str]) -> list[str]:
    """The Hydra overrides equivalent to `flags`; ConfigError names any flag we cannot take."""
    args, unknown = _parser().parse_known_args(flags)
    if unknown:
        raise ConfigError(f"unknown flag(s) {unknown}: not a flag of the GRPO CLI family this translator knows. "
                          "Set the equivalent Hydra key directly (python -m grpo_pipeline --cfg job lists them).")
    given = {k for k, v in vars(args).items() if v not in (None, False)}
    for flag, reason in REJECTED.items():
        if flag[2:].replace("-", "_") in given:
            raise ConfigError(f"{flag} is not supported: {reason}")
    if args.task not in (None, "llm"):
        raise ConfigError(f"task {args.task!r} is not supported: this pipeline trains language models (llm) only.")
    if args.trainer not in (None, "grpo"):
        raise ConfigError(f"--trainer {args.trainer} is not supported: this pipeline trains GRPO only.")
    out: list[str] = []
    if args.model:
        out += ["model=hub", f"model.name_or_path={_value(args.model)}"]
    if args.rl_env_module or args.rl_env_class:
        if not (args.rl_env_module and args.rl_env_class):
            raise ConfigError("--rl-env-module and --rl-env-class go together (module path + class name).")
        out += ["env=custom", f"env._target_={args.rl_env_module}.{args.rl_env_class}"]
    if args.rl_env_config is not None:
        out += _env_config(args.rl_env_config, custom=bool(args.rl_env_module))
    if args.project_name:
        out.append(f"tracking.experiment_name={_value(args.project_name)}")
    loss_type = args.rl_loss_type or "grpo"
    if loss_type not in LossType.__members__:
        raise ConfigError(f"--rl-loss-type {loss_type}: use one of {', '.join(LossType)}.")
    if args.loss_preset:  # this project's preset for that loss, whole (its KL, clipping, masking)
        out.append(f"loss={loss_type}")
    else:  # the loss type alone, on the documents' defaults
        out += ["loss=grpo"] + ([f"loss.loss_type={loss_type}"] if loss_type != "grpo" else [])
    if args.rl_mask_truncated_completions:
        out.append("loss.mask_truncated_completions=true")
    out += _vllm(args, given)
    lora_flags = [f for f in ("lora_r", "lora_alpha", "lora_dropout") if f in given]
    if lora_flags and not args.peft:
        raise ConfigError(f"--{lora_flags[0].replace('_', '-')} needs --peft (LoRA is off without it).")
    out.append("lora=default" if args.peft else "lora=off")  # without --peft those CLIs fine-tune fully
    out.append("training.max_steps=-1")  # epochs decide, as there
    set_keys = {o.split("=", 1)[0] for o in out}
    for flag, (key, _) in VALUE_FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and not flag.startswith("--vllm"):
            out.append(f"{key}={_value(value)}")
            set_keys.add(key)
    preset = args.loss_preset  # a preset keeps its own KL, clipping and masking unless a flag sets them
    for key, value in DOCUMENTED_DEFAULTS.items():
        if key not in set_keys and not (preset and key.startswith("loss.")):
            out.append(f"{key}={_value(value)}")
    return out


def _env_config(raw: str, custom: bool) -> list[str]:
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--rl-env-config is not valid JSON ({e.msg} at position {e.pos}): {raw!r}. "
                          """Pass an object, e.g. '{"max_turns": 5, "difficulty": "hard"}'.""") from e
    if not isinstance(config, dict):
        raise ConfigError(f"--rl-env-config must be a JSON object of constructor kwargs, got {type(config).__name__}.")
    # keys the chosen env option does not list must be added with '+'; with env=custom, every key is new
    return [f"{'+' if custom else '++'}env.{k}={_value(v)}" for k, v in config.items()]


def _vllm(args, given: set[str]) -> list[str]:
    vllm_flags = sorted(f for f in given if f.startswith("vllm_"))
    if not args.use_vllm:
        if vllm_flags:
            raise ConfigError(f"--{vllm_flags[0].replace('_', '-')} has no effect without --use-vllm.")
        return []
    mode = args.vllm_mode or "colocate"
    if mode not in ("colocate", "server"):
        raise ConfigError(f"--vllm-mode {mode}: use colocate or server.")
    out = [f"vllm={mode}"]
    for flag, (key, _) in VALUE_FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if flag.startswith("--vllm") and value is not None:
            out.append(f"{key}={_value(value)}")
    return out


def main(argv: list[str]) -> None:
    run = "--run" in argv[: argv.index("--")] if "--" in argv else "--run" in argv
    flags = argv[argv.index("--") + 1:] if "--" in argv else [a for a in argv if a != "--run"]
    try:
        overrides = translate(flags)
    except ConfigError as e:
        sys.exit(f"ERROR: {e}")
    from grpo_pipeline.tracking.redact import mask_override, register_overrides

    register_overrides(overrides)  # --rl-env-config '{"api_key": ...}': printed masked, run with the real value
    command = [sys.executable, "-m", "grpo_pipeline", *overrides]
    print("python -m grpo_pipeline " + " ".join(shlex.quote(mask_override(o)) for o in overrides))
    print("Flags not given take the documents' defaults (above). This project adds:", file=sys.stderr)
    for line in ADDED_BEHAVIOURS:
        print(f"  - {line}", file=sys.stderr)
    if run:
        sys.exit(subprocess.call(command))
