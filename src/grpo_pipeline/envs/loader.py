"""Find, validate and instantiate the user's environment class, then build and check its dataset.

The contract (what a user writes):

    class MyEnv:
        def __init__(self, **kwargs): ...                      # kwargs come from the `env` config node
        def build_dataset(self, tokenizer) -> datasets.Dataset  # a `prompt` column + any extra columns
        def score_episode(self, model, tokenizer, completion, **extra_columns) -> float  # in [0, 1]
        def get_tools(self) -> list[dict]                      # optional, OpenAI function-calling schemas
        thread_safe = True                                      # optional; False scores one episode at a time

Every check runs before any model weights load, and each failure is one message naming the
class or key and the fix.
"""

import importlib
import inspect
import os
import sys
from typing import Any

from datasets import Dataset

from grpo_pipeline.errors import ConfigError

REQUIRED_METHODS = ("build_dataset", "score_episode")


def resolve_env_class(target: Any) -> type:
    """`target` is a dotted path 'pkg.module.Class', or already a class."""
    if isinstance(target, type):
        return target
    if not isinstance(target, str) or "." not in target:
        raise ConfigError(
            f"env._target_={target!r} is not a dotted path. Set it to 'package.module.ClassName', "
            "e.g. env._target_=my_envs.hotel_env.HotelEnv."
        )
    # `python -m` puts the launch directory on sys.path; the console script does not. Do the same for both.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    module_name, class_name = target.rsplit(".", 1)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ConfigError(
            f"env._target_='{target}': module '{module_name}' cannot be imported ({e}). Check the spelling, and "
            f"that the module lies under the directory you launch from ({os.getcwd()}) or is installed."
        ) from e
    except Exception as e:
        raise ConfigError(
            f"env._target_='{target}': importing module '{module_name}' raised {e.__class__.__name__}: {e}. "
            "Fix the error in that module."
        ) from e
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        found = sorted(n for n, v in vars(module).items() if isinstance(v, type) and v.__module__ == module.__name__)
        raise ConfigError(
            f"env._target_='{target}': module '{module_name}' has no class '{class_name}'. "
            f"Classes defined there: {found or 'none'}."
        )
    return cls


def check_env_class(cls: type) -> None:
    missing = [m for m in REQUIRED_METHODS if not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError(
            f"Env class {cls.__qualname__} lacks {', '.join(missing)}. An env defines "
            "build_dataset(self, tokenizer) -> datasets.Dataset and "
            "score_episode(self, model, tokenizer, completion, **extra_columns) -> float."
        )


def check_env_kwargs(cls: type, kwargs: dict) -> None:
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        params = [p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs")]
        raise ConfigError(
            f"env: {cls.__qualname__} does not accept the config's kwargs {sorted(kwargs)} ({e}). "
            f"Its constructor takes {params}; fix or remove the key under env."
        ) from e


def load_env(env_cfg: dict, env: Any = None) -> Any:
    """Instantiate the env from its config node: {_target_: ..., **constructor_kwargs}.
    `env`, when given, is an env class (instantiated with the node's kwargs) or a ready instance."""
    env_cfg = dict(env_cfg)
    target = env_cfg.pop("_target_", None)
    if env is not None and not isinstance(env, type):
        check_env_class(type(env))
        return env
    target = env if env is not None else target
    if target is None:
        raise ConfigError(
            "env._target_ is missing. Pick an env (env=arithmetic, env=hotel) or set "
            "env._target_=my_module.MyEnv (plus its constructor kwargs as env.<name>=...)."
        )
    cls = resolve_env_class(target)
    check_env_class(cls)
    check_env_kwargs(cls, env_cfg)
    try:
        return cls(**env_cfg)
    except Exception as e:
        raise ConfigError(
            f"env: {cls.__qualname__}(**{env_cfg}) raised {e.__class__.__name__}: {e}. "
            "Fix the constructor kwargs under env."
        ) from e


def build_env_dataset(env: Any, tokenizer) -> Dataset:
    name = type(env).__qualname__
    try:
        dataset = env.build_dataset(tokenizer)
    except Exception as e:
        raise ConfigError(f"{name}.build_dataset(tokenizer) raised {e.__class__.__name__}: {e}.") from e
    if not isinstance(dataset, Dataset):
        raise ConfigError(
            f"{name}.build_dataset returned {type(dataset).__name__}; return a datasets.Dataset, "
            "e.g. Dataset.from_list([{'prompt': ..., 'answer': ...}, ...])."
        )
    if "prompt" not in dataset.column_names:
        raise ConfigError(
            f"{name}.build_dataset returned columns {dataset.column_names} without 'prompt'. "
            "Add a 'prompt' column (text, or chat messages [{'role': 'user', 'content': ...}])."
        )
    if len(dataset) == 0:
        raise ConfigError(f"{name}.build_dataset returned an empty dataset.")
    for i, prompt in enumerate(dataset["prompt"]):
        if not _is_prompt(prompt):
            raise ConfigError(
                f"{name}.build_dataset: row {i} has prompt {str(prompt)[:80]!r}; a prompt is a non-empty string "
                "or a list of {'role': ..., 'content': str} messages."
            )
    return dataset


def _is_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return bool(prompt)
    return (
        isinstance(prompt, list)
        and len(prompt) > 0
        and all(isinstance(m, dict) and "role" in m and isinstance(m.get("content"), str) for m in prompt)
    )


def get_tool_schemas(env: Any) -> list[dict]:
    get_tools = getattr(env, "get_tools", None)
    if get_tools is None:
        return []
    tools = get_tools() or []
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or "name" not in fn:
            raise ConfigError(
                f"{type(env).__qualname__}.get_tools()[{i}] is not an OpenAI function schema "
                "({'type': 'function', 'function': {'name': ..., 'description': ..., 'parameters': {...}}})."
            )
    return tools


def get_tool_functions(env: Any, tokenizer) -> list:
    """The env's tools as Python callables (optional `get_tool_functions()`), for TRL's tool loop: the
    model's tool calls are executed during generation and the results fed back before scoring."""
    get_functions = getattr(env, "get_tool_functions", None)
    if get_functions is None:
        return []
    functions = list(get_functions() or [])
    name = type(env).__qualname__
    for i, fn in enumerate(functions):
        if not callable(fn) or not getattr(fn, "__doc__", None):
            raise ConfigError(f"{name}.get_tool_functions()[{i}] must be a callable with type hints and a "
                              "Google-style docstring (TRL builds the tool schema from them).")
    from trl.chat_template_utils import supports_tool_calling

    if functions and not supports_tool_calling(tokenizer):
        raise ConfigError(
            f"{name}.get_tool_functions() gives tools for TRL's tool loop, but the model's chat template cannot "
            "render tool calls. Use a model whose template can (e.g. Qwen2.5/Qwen3 instruct), or drop "
            "get_tool_functions and run the tools inside score_episode from get_tools() schemas (as env=hotel does)."
        )
    return functions
