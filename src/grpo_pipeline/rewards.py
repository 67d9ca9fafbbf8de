"""Assemble TRL reward functions from the `reward` config group.

The env's score (through the env runtime) is one reward with weight `reward.env_weight`; every entry of
`reward.components` is another: `{_target_: a callable, weight: float, **kwargs}`. A component is called
like a TRL reward function, `fn(prompts=..., completions=..., **dataset_columns, **kwargs) -> list[float]`,
and TRL logs each under `rewards/<name>/mean`.
"""

from collections.abc import Callable

from hydra.utils import instantiate
from omegaconf import OmegaConf

from grpo_pipeline.config.schema import RewardConfig
from grpo_pipeline.errors import ConfigError


def build_rewards(cfg: RewardConfig, env_reward: Callable) -> tuple[list[Callable], list[float]]:
    funcs, weights = [], []
    if cfg.env_weight > 0:
        funcs.append(env_reward)
        weights.append(float(cfg.env_weight))
    for name, spec in cfg.components.items():
        spec = OmegaConf.to_container(spec) if OmegaConf.is_config(spec) else dict(spec)
        weight = float(spec.pop("weight", 1.0))
        if "_target_" not in spec:
            raise ConfigError(f"reward.components.{name} has no _target_: set it to a reward callable's dotted path.")
        try:
            fn = instantiate(spec, _partial_=True)
        except Exception as e:
            raise ConfigError(
                f"reward.components.{name}._target_={spec['_target_']!r} cannot be built: {str(e).splitlines()[0]}"
            ) from e
        funcs.append(_named(fn, name))
        weights.append(weight)
    return funcs, weights


def _named(fn: Callable, name: str) -> Callable:
    def reward(prompts, completions, **kwargs):
        return fn(prompts=prompts, completions=completions, **kwargs)

    reward.__name__ = name  # TRL names the metric rewards/<name>/mean after it
    return reward
