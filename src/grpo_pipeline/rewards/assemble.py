"""Assemble TRL reward functions from the `reward` config group.

The env's score (through the env runtime) is one reward with weight `reward.env_weight`; every entry of
`reward.components` is another: `{_target_: a callable, weight: float, **kwargs}`. A component is called
like a TRL reward function, `fn(prompts=..., completions=..., **dataset_columns, **kwargs) -> list[float]`,
and TRL logs each under `rewards/<name>/mean`.
"""

import inspect
from collections.abc import Callable

from hydra.utils import instantiate
from omegaconf import OmegaConf

from grpo_pipeline.config.schema import RewardConfig
from grpo_pipeline.errors import ConfigError

_TRL_KWARGS = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments"}


def build_rewards(cfg: RewardConfig, env_reward: Callable, columns: list[str]) -> tuple[list[Callable], list[float]]:
    """The reward functions and their weights; `columns` are the dataset's, checked against what components need."""
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
        missing = [c for c in _required_columns(fn) if c not in columns]
        if missing:
            raise ConfigError(
                f"reward.components.{name} needs dataset column(s) {missing}, which the env's dataset lacks "
                f"(columns: {columns}). Add them in build_dataset, or drop the component."
            )
        funcs.append(_named(fn, name, env_reward if cfg.env_weight > 0 else None))
        weights.append(weight)
    return funcs, weights


def _required_columns(fn: Callable) -> list[str]:
    params = inspect.signature(fn).parameters.values()
    return [
        p.name for p in params
        if p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.name not in _TRL_KWARGS
    ]


def _named(fn: Callable, name: str, env_reward: Callable | None) -> Callable:
    """`fn` as a TRL reward named `name`. Where the env's episode failed in this batch (TRL calls the env's reward
    first, in list order, with the same `completions` list), the component returns None too: the completion is
    unscorable as a whole (TRL: no advantage, out of the group's baseline) rather than scored by its format alone."""

    def reward(prompts, completions, **kwargs):
        scores = fn(prompts=prompts, completions=completions, **kwargs)
        batch, failed = getattr(env_reward, "failed", (None, []))
        if batch is not completions:  # not the batch the env just scored (e.g. a direct call)
            return scores
        return [None if f else s for s, f in zip(scores, failed, strict=True)]

    reward.__name__ = name  # TRL names the metric rewards/<name>/mean after it
    return reward
