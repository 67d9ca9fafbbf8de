"""The run plan: every "null = choose for me" decision of a run, made once, before weights load.

`make_plan` looks at the config, the env (does it have `respond`, tool functions, its own turn limits), the
machine (GPU or CPU, what its CPU does fast: config/machine.py) and the data (how many training prompts, the
held-out split) and decides, with the reason for each:
- which backend generates: the runtime's decode loop, the runtime through vLLM, TRL, or TRL's vLLM / tool loop;
- the sampling copy: merged or not, its dtype, prepacked weights, vLLM's weight sync;
- a multi-turn episode's limits; the step's shape fitted to the data; the held-out sizes; the loss path.
The recipe prints it as a table, writes it to `<run dir>/plan.json` and logs it to MLflow; the parts of the
run take their decisions from it (nothing decides twice). The config itself is never changed: `applied(cfg)`
is a copy with the fitted step shape. `python -m grpo_pipeline ... --plan` prints the plan and runs nothing.
"""

import copy
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from grpo_pipeline.config.validate import fit_step
from grpo_pipeline.errors import ConfigError

log = logging.getLogger(__name__)
PLAN_FILE = "plan.json"


@dataclass(frozen=True)
class Choice:
    key: str
    value: Any
    why: str


@dataclass(frozen=True)
class RunPlan:
    backend: str  # runtime | runtime+vllm | trl | trl+vllm | trl+tools
    multi_turn: bool
    device: str  # cpu | cuda
    generation_dtype: str | None  # the sampling copy's dtype; None: the policy's own
    merged_generation: bool
    packed_generation: bool
    weight_sync: str | None  # the runtime's vLLM: weights | adapter
    max_turns: int
    turn_tokens: int
    max_episode_tokens: int
    step: dict[str, Any]  # the step's shape: training.batch_size, generation.oversample, ...
    train_prompts: int
    val_prompts: int
    test_prompts: int
    recipe: dict[str, Any] = field(default_factory=dict)  # training.learning_rate, .max_steps, .num_epochs
    vllm_engine: dict[str, Any] | None = None  # the runtime's vLLM (backend runtime+vllm): VllmBackend's settings
    turn_credit: str = "episode"  # runtime.turn_credit: episode | turn (multi-turn envs)
    choices: tuple[Choice, ...] = field(default=())

    @property
    def runtime_generates(self) -> bool:
        return self.backend.startswith("runtime")

    @property
    def runtime_vllm(self) -> bool:
        return self.backend == "runtime+vllm"

    def applied(self, cfg: DictConfig) -> DictConfig:
        """A copy of `cfg` with the recipe's choices and the fitted step shape (the config given is not changed)."""
        out = copy.deepcopy(cfg)
        for key, value in {**self.recipe, **self.step}.items():
            OmegaConf.update(out, key, value)
        return out

    def table(self) -> str:
        width = max(len(c.key) for c in self.choices)
        lines = [f"Run plan ({PLAN_FILE}):"]
        lines += [f"  {c.key:<{width}}  {_show(c.value):<10}  {c.why}" for c in self.choices]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        data = asdict(self)
        data["choices"] = [asdict(c) for c in self.choices]
        return data

    def write(self, run_dir: Path) -> Path:
        from grpo_pipeline.training.checkpoints import write_durably

        path = Path(run_dir) / PLAN_FILE
        write_durably(path, json.dumps(self.as_dict(), indent=2, default=str))
        return path


def make_plan(cfg: DictConfig, env: Any, tokenizer, split, tool_functions: list, env_name: str) -> RunPlan:
    """Decide once what the run does on this machine, for this env and data (see the module's doc)."""
    import torch

    from grpo_pipeline.config.validate import vllm_in_runtime, weight_sync

    choices: list[Choice] = []
    gpu = torch.cuda.is_available() and not cfg.training.use_cpu
    multi_turn = callable(getattr(env, "respond", None))
    _refuse_backend_conflicts(cfg, env_name, multi_turn, bool(tool_functions), gpu)
    in_runtime = vllm_in_runtime(cfg, bool(tool_functions))
    if tool_functions:
        backend, why = "trl+tools", f"{env_name}.get_tool_functions: TRL's tool loop runs the tool calls"
    elif cfg.vllm.mode != "off" and not in_runtime:
        backend, why = "trl+vllm", f"vllm={cfg.vllm.mode}: TRL's vLLM generates ({'server' if cfg.vllm.mode == 'server' else 'full fine-tuning on GPUs'})"
    elif in_runtime:
        backend, why = "runtime+vllm", "vllm=colocate: the runtime generates through an in-process vLLM"
    else:
        backend = "runtime"
        why = (f"{env_name} has respond(): the runtime generates every turn" if multi_turn else
               "the runtime's batched decode loop (shared-prefix KV cache, log-probs of the sampled tokens)")
    choices.append(Choice("backend", backend, why))
    runtime = backend.startswith("runtime")

    merged = cfg.runtime.merged_generation
    merged_why = "runtime.merged_generation"
    if merged is None:
        merged, merged_why = not gpu, ("on a CPU: a W + BA copy decodes without the adapter's per-token cost"
                                       if not gpu else "on GPUs: the policy itself")
    packed, packed_why = packed_generation(cfg, gpu)
    dtype, dtype_why = generation_dtype(cfg, multi_turn, gpu, packed)
    sync = weight_sync(cfg) if backend == "runtime+vllm" else None
    if runtime:
        choices.append(Choice("runtime.merged_generation", merged, merged_why))
        choices.append(Choice("runtime.generation_dtype", dtype or cfg.model.dtype, dtype_why))
        choices.append(Choice("runtime.packed_generation", packed, packed_why))
    if sync is not None:
        choices.append(Choice("vllm.weight_sync", sync, "vllm.weight_sync" if cfg.vllm.weight_sync else
                              "null: merged weights on a CPU or without LoRA, the adapter for LoRA on GPUs"))

    max_turns, turn_tokens = 1, cfg.generation.max_new_tokens
    max_episode_tokens = turn_tokens
    if multi_turn:
        env_turns, env_tokens = getattr(env, "max_turns", None), getattr(env, "turn_max_new_tokens", None)
        max_turns = int(env_turns or cfg.runtime.max_turns)
        turn_tokens = int(env_tokens or cfg.generation.max_new_tokens)
        max_episode_tokens = cfg.runtime.max_episode_tokens
        scored = callable(getattr(env, "score_turn", None))
        choices.append(Choice("runtime.turn_credit", cfg.runtime.turn_credit,
                              "each assistant turn its own advantage" + (f" ({env_name}.score_turn and the episode's "
                                                                         "reward)" if scored else
                                                                         " (no score_turn: the episode's reward)")
                              if cfg.runtime.turn_credit == "turn" else "every turn the episode's advantage"))
        choices.append(Choice("turns", f"{max_turns} x {turn_tokens}",
                              f"assistant turns x tokens a turn ({'the env' if env_turns else 'runtime.max_turns'}, "
                              f"{'the env' if env_tokens else 'generation.max_new_tokens'}); at most "
                              f"{max_episode_tokens} tokens an episode (runtime.max_episode_tokens)"))

    recipe, recipe_lines = recipe_choices(cfg)
    choices += recipe_lines
    step, said = fit_step(cfg, len(split.train), env_name)
    shape = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in step.items())
    choices.append(Choice("step", shape, said or "as configured"))
    n_val = len(split.val) if split.val is not None else 0
    n_test = len(split.test) if split.test is not None else 0
    choices.append(Choice("held-out", f"{n_test} + {n_val}",
                          "test + validation prompts" + ("" if cfg.eval.enabled else " (eval.enabled=false)")
                          + f"; {len(split.train)} training prompts"))
    if n_test or n_val:
        choices.append(Choice("eval.reward", cfg.eval.reward, _eval_reward_why(cfg)))
    loss = cfg.loss
    choices.append(Choice("loss", loss.loss_type, f"beta (loss.kl_coef)={loss.kl_coef:g}"
                          + (" with a reference model" if loss.kl_coef else ", no reference model")
                          + f", clip {loss.clip_range:g}" + (f"/{loss.epsilon_high:g}" if loss.epsilon_high else "")))
    engine = None
    if backend == "runtime+vllm":
        engine = {"dtype": cfg.model.dtype, "max_model_len": cfg.vllm.max_model_len, "sync": sync,
                  "lora_rank": cfg.lora.r if cfg.lora.enabled else None,
                  "gpu_memory_utilization": cfg.vllm.gpu_memory_utilization, "seed": cfg.seed}
    return RunPlan(backend=backend, multi_turn=multi_turn, device="cuda" if gpu else "cpu",
                   generation_dtype=dtype, merged_generation=bool(merged), packed_generation=packed,
                   weight_sync=sync, max_turns=max_turns, turn_tokens=turn_tokens,
                   max_episode_tokens=max_episode_tokens, step=step, train_prompts=len(split.train),
                   turn_credit=str(cfg.runtime.turn_credit),
                   val_prompts=n_val, test_prompts=n_test, recipe=recipe, vllm_engine=engine,
                   choices=tuple(choices))


STEPS = 50  # training.max_steps=null without num_epochs: the default run's length (~9-12 min, docs/results.md)
LORA_LR = 1e-4  # a LoRA rate for a model nobody tuned here: ~10x full fine-tuning's (Schulman et al. 2025,
# "LoRA Without Regret": LoRA's best RL rate sits about an order of magnitude above full fine-tuning's)
FULL_LR = 1e-5  # full fine-tuning: the 1e-6..1e-5 class GRPO guides start from (the seed documents: "start at 1e-5")


def recipe_choices(cfg) -> tuple[dict[str, Any], list[Choice]]:
    """The learning rate and the run's length where the config leaves them null, from the model and the
    fine-tuning mode: a conf/recipe/<model>_<lora>.yaml sets what was tuned for that pair (cfg.recipe names it);
    any other model gets a generic rate for its mode, never the one tuned for SmolLM2."""
    train, out, lines = cfg.training, {}, []
    mode = "LoRA" if cfg.lora.enabled else "full fine-tuning"
    if train.learning_rate is None:
        lr = LORA_LR if cfg.lora.enabled else FULL_LR
        out["training.learning_rate"] = lr
        lines.append(Choice("training.learning_rate", lr, f"{mode} of {cfg.model.name}, not tuned here: "
                            + ("LoRA's rate (~10x full fine-tuning's)" if cfg.lora.enabled else
                               "the 1e-6..1e-5 class GRPO guides start from") + "; set training.learning_rate"))
    else:
        lines.append(Choice("training.learning_rate", train.learning_rate,
                            f"conf/recipe/{cfg.recipe}.yaml: tuned for {cfg.model.name} with {mode}" if cfg.recipe
                            else "training.learning_rate"))
    if train.max_steps is None:
        steps = -1 if train.num_epochs is not None else STEPS
        out["training.max_steps"] = steps
        if train.num_epochs is None:
            out["training.num_epochs"] = 1.0
        lines.append(Choice("training.max_steps", steps, f"training.num_epochs={train.num_epochs:g} decides"
                            if steps < 0 else "the default length (training.num_epochs or training.max_steps "
                            "sets another)"))
    elif train.max_steps > 0 and train.num_epochs is not None:
        log.warning("training.num_epochs=%g is ignored: training.max_steps=%d bounds the run (as in transformers). "
                    "Set training.max_steps=-1 (or leave it null) to train by epochs.", train.num_epochs,
                    train.max_steps)
        lines.append(Choice("training.max_steps", train.max_steps, f"given; training.num_epochs={train.num_epochs:g}"
                            " is ignored"))
    elif train.num_epochs is None:
        out["training.num_epochs"] = 1.0
    return out, lines


def _eval_reward_why(cfg) -> str:
    trained = " + ".join([f"{cfg.reward.env_weight:g} x env"] * (cfg.reward.env_weight > 0)
                         + [f"{c.get('weight', 1.0):g} x {name}" for name, c in cfg.reward.components.items()])
    if cfg.eval.reward == "total":
        return f"held-out episodes score the reward training sums: {trained}"
    only_env = not cfg.reward.components and cfg.reward.env_weight > 0
    return "held-out episodes score the env's score alone" + (
        "" if only_env else f" (training sums {trained}; eval.reward=total scores that)")


def generation_dtype(cfg, multi_turn: bool = False, gpu: bool | None = None,
                     packed: bool | None = None) -> tuple[str | None, str]:
    """(the sampling copy's dtype, or None for the model's own; why). null: bfloat16 for a single-turn env's float32
    model on a CPU where bf16 matmuls measure faster (config/machine.py); the model's own otherwise (a multi-turn
    env=hotel step measured slower in bf16, cause not found)."""
    from grpo_pipeline.config import machine

    gpu = _gpu(cfg) if gpu is None else gpu
    name = cfg.runtime.generation_dtype
    if name is not None:
        why = "runtime.generation_dtype"
    elif gpu:
        why = "null on GPUs: the model's own dtype"
    elif multi_turn:
        why = "null for a multi-turn env: the model's own (a hotel step measured slower in bf16)"
    elif cfg.model.dtype != "float32":
        why = f"null: the model's own {cfg.model.dtype}"
    else:
        choice = machine.sampling_dtype(packed_generation(cfg, gpu)[0] if packed is None else packed)
        name, why = choice.value, f"null: {choice.why}"
    return (None if name is None or name == cfg.model.dtype else name), why


def packed_generation(cfg, gpu: bool | None = None) -> tuple[bool, str]:
    """runtime.packed_generation resolved, and why: null packs where the copies run float32 on a CPU with oneDNN
    and packing measures faster there (config/machine.py)."""
    from grpo_pipeline.config import machine
    from grpo_pipeline.rollout.policy_copy import can_pack

    cpu = not (_gpu(cfg) if gpu is None else gpu)
    possible = cpu and cfg.model.dtype == "float32" and can_pack()
    if cfg.runtime.packed_generation is None:
        if not possible:
            return False, "null: prepacking is oneDNN's float32 CPU matmul, not this run's"
        return machine.packing_choice()
    if cfg.runtime.packed_generation and not possible:
        why = ("generates on a GPU" if not cpu else "has no oneDNN in its torch" if not can_pack()
               else f"runs model.dtype={cfg.model.dtype} (packed here: float32 only)")
        raise ConfigError(f"runtime.packed_generation=true: prepacked weights are oneDNN's CPU matmul, and this run "
                          f"{why}; use null (chosen per machine) or false.")
    return bool(cfg.runtime.packed_generation), "runtime.packed_generation"


def _gpu(cfg) -> bool:
    import torch

    return torch.cuda.is_available() and not cfg.training.use_cpu


def _refuse_backend_conflicts(cfg, env_name: str, multi_turn: bool, tools: bool, gpu: bool) -> None:
    from grpo_pipeline.config.validate import vllm_in_runtime

    if multi_turn and tools:
        raise ConfigError(f"{env_name} has both respond() and get_tool_functions(): a multi-turn env runs its tools "
                          "in respond; drop get_tool_functions.")
    if tools and vllm_in_runtime(cfg) and not gpu:
        raise ConfigError(f"vllm=colocate with {env_name}.get_tool_functions: TRL's tool loop generates those "
                          "episodes through TRL's own vLLM, which cannot take the policy's weights on a CPU (vLLM's "
                          "CPU build fails the weight push). Use vllm=off here, or run the tools in a multi-turn "
                          "env's respond() (the runtime serves that through vLLM).")
    if cfg.runtime.turn_credit == "turn" and not multi_turn:
        raise ConfigError(f"runtime.turn_credit=turn: {env_name} has no respond(), so its episodes have one assistant "
                          "turn the runtime knows of. Per-turn credit needs a multi-turn env (respond); leave "
                          "runtime.turn_credit=episode.")
    if cfg.runtime.turn_credit == "turn":
        for key, value in (("generation.flat_negative", cfg.generation.flat_negative),
                           ("generation.resample_flat", cfg.generation.resample_flat)):
            if value:
                raise ConfigError(f"runtime.turn_credit=turn with {key}={value}: that dynamic-sampling option rewrites "
                                  f"episode advantages, which per-turn credit replaces; set {key}=0 (or "
                                  "runtime.turn_credit=episode).")
        if cfg.reward.aggregation != "sum_then_normalize":
            raise ConfigError(f"runtime.turn_credit=turn with reward.aggregation={cfg.reward.aggregation}: per-turn "
                              "credit adds turn scores to each episode's reward total (sum_then_normalize); use "
                              "reward.aggregation=sum_then_normalize or runtime.turn_credit=episode.")
    if multi_turn and cfg.vllm.mode != "off" and not vllm_in_runtime(cfg, tools):
        raise ConfigError(f"vllm={cfg.vllm.mode} with the multi-turn {env_name}: multi-turn episodes are generated by "
                          "the runtime, which serves vLLM as vllm=colocate with LoRA (lora=default) on GPUs, and as "
                          "any vllm=colocate run on a CPU; use that, or vllm=off.")


def _show(value: Any) -> str:
    return "on" if value is True else "off" if value is False else str(value)
