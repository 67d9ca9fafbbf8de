"""Find, validate and instantiate the user's environment class, then build and check its dataset.

The contract (what a user writes):

    class MyEnv:
        def __init__(self, **kwargs): ...                      # kwargs come from the `env` config node
        def build_dataset(self, tokenizer) -> datasets.Dataset  # a `prompt` column + any extra columns
        def score_episode(self, model, tokenizer, completion, **extra_columns) -> float  # in [0, 1]
        def get_tools(self) -> list[dict]                      # optional, OpenAI function-calling schemas
        thread_safe = True                                      # optional; False scores one episode at a time
        describes_tools = False                                 # optional; True: the prompts already describe
                                                                # the tools (no preamble where no template renders them)

The `env` node is instantiated with Hydra's semantics: nested `_target_` nodes become objects (a nested
`_partial_: true` gives a callable), `_args_` are positional arguments, plain dicts and lists arrive as
plain Python containers (`_convert_: all` unless the node sets `_convert_`). Every check runs before any
model weights load, and each failure is one message naming the class or key and the fix.

The launch directory is importable only while the env's module and its nested targets are imported,
so it never shadows an installed package (a local `datasets.py`) for the rest of the process.
"""

import importlib
import inspect
import os
import re
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from datasets import Dataset

from grpo_pipeline.errors import ConfigError
from grpo_pipeline.tracking.redact import MASK, is_secret_key, looks_secret, mask_secrets

REQUIRED_METHODS = ("build_dataset", "score_episode")
# Dataset columns reach score_episode (and TRL's reward functions) as keyword arguments: these names are taken by
# score_episode's own arguments, TRL's reward-function arguments and the runtime's columns.
RESERVED_COLUMNS = ("model", "tokenizer", "completion", "completions", "completion_ids", "prompts", "prompt_ids",
                    "trainer_state", "log_metric", "log_extra", "environments", "transcript", "episode_failure",
                    "env_mask", "logprobs", "turn_scores", "opening", "episode_seed", "self")
_HYDRA_KEYS = ("_target_", "_args_", "_partial_", "_convert_", "_recursive_")
# Top-level modules imported from a launch directory -> that directory (see importable_from).
_IMPORTED_FROM: dict[str, str] = {}


@contextmanager
def importable_from(launch_dir: str | os.PathLike | None = None) -> Iterator[None]:
    """Make `launch_dir` (default: the working directory) importable for the duration of the block.

    Modules that an earlier block imported from a *different* launch directory are forgotten first, so
    two runs from two directories, each with its own `my_env.py`, each get their own module."""
    where = os.path.realpath(launch_dir or os.getcwd())
    for name, source in list(_IMPORTED_FROM.items()):
        if source != where:
            _forget(name)
    added = where not in sys.path
    if added:
        sys.path.insert(0, where)
    before = set(sys.modules)
    importlib.invalidate_caches()  # files written since the last import (a notebook, a test) are seen
    try:
        yield
    finally:
        if added and where in sys.path:
            sys.path.remove(where)
        for name in set(sys.modules) - before:
            if "." not in name and _lies_directly_in(sys.modules[name], where):
                _IMPORTED_FROM[name] = where


def _forget(top_level: str) -> None:
    for name in [n for n in sys.modules if n == top_level or n.startswith(top_level + ".")]:
        del sys.modules[name]
    _IMPORTED_FROM.pop(top_level, None)


def _lies_directly_in(module: Any, directory: str) -> bool:
    """Whether the module was found through `directory` itself (a.py or a/ right there), not installed
    somewhere below it (e.g. in a .venv inside the launch directory)."""
    spec = getattr(module, "__spec__", None)
    if spec is None:
        return False
    if spec.submodule_search_locations:  # a package (or namespace package): its folder
        paths = list(spec.submodule_search_locations)
    elif spec.has_location and spec.origin:
        paths = [spec.origin]
    else:
        return False
    return any(os.path.dirname(os.path.realpath(p)) == directory for p in paths)


def env_name(env: Any) -> str:
    """How messages name the env: its class, or what a wrapper says it wraps (`display_name`, envs/trl_env.py)."""
    return getattr(env, "display_name", None) or type(env).__qualname__


def resolve_env_class(target: Any) -> type:
    """`target` is a dotted path 'pkg.module.Class' (import it inside `importable_from`), or already a class."""
    return target if isinstance(target, type) else _locate(target, "env", "class")


def _locate(target: Any, key: str, kind: str) -> Any:
    """The class (kind 'class') or callable at dotted path `target`, the `_target_` of config key `key`."""
    if not isinstance(target, str) or "." not in target:
        raise ConfigError(
            f"{key}._target_={target!r} is not a dotted path. Set it to 'package.module.ClassName', "
            "e.g. env._target_=my_envs.hotel_env.HotelEnv."
        )
    module_name, name = target.rsplit(".", 1)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ConfigError(
            f"{key}._target_='{target}': module '{module_name}' cannot be imported ({e}). Check the spelling, and "
            f"that the module lies under the directory you launch from ({os.getcwd()}) or is installed."
        ) from e
    except Exception as e:
        raise ConfigError(
            f"{key}._target_='{target}': importing module '{module_name}' raised {e.__class__.__name__}: {e}. "
            "Fix the error in that module."
        ) from e
    found = getattr(module, name, None)
    if not (isinstance(found, type) if kind == "class" else callable(found)):
        classes = sorted(n for n, v in vars(module).items() if isinstance(v, type) and v.__module__ == module.__name__)
        raise ConfigError(
            f"{key}._target_='{target}': module '{module_name}' has no {kind} '{name}'. "
            f"Classes defined there: {classes or 'none'}."
        )
    return found


def check_env_class(cls: type) -> None:
    missing = [m for m in REQUIRED_METHODS if not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError(
            f"Env class {cls.__qualname__} lacks {', '.join(missing)}. An env defines "
            "build_dataset(self, tokenizer) -> datasets.Dataset and "
            "score_episode(self, model, tokenizer, completion, **extra_columns) -> float."
        )


def check_env_kwargs(cls: type, kwargs: dict, args: list | tuple = ()) -> None:
    _check_call(cls, list(args), kwargs, "env")


def _check_call(target: Any, args: list, kwargs: dict, key: str, partial: bool = False) -> None:
    """The config's `_args_` and kwargs must bind to the target's signature (only some of them for a partial)."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # some builtins have no signature to check against
        return
    try:
        (signature.bind_partial if partial else signature.bind)(*args, **kwargs)
    except TypeError as e:
        given = f"_args_ {args} and kwargs {sorted(kwargs)}" if args else f"kwargs {sorted(kwargs)}"
        params = [p for p in signature.parameters if p not in ("self", "args", "kwargs")]
        name = getattr(target, "__qualname__", repr(target))
        takes = "constructor takes" if isinstance(target, type) else "signature takes"
        raise ConfigError(
            f"{key}: {name} does not accept the config's {given} ({e}). "
            f"Its {takes} {params}; fix or remove the key under {key}."
        ) from e


def _split(node: Mapping, key: str) -> tuple[list, dict]:
    """(`_args_`, kwargs) of a config node."""
    args = node.get("_args_", [])
    if not isinstance(args, list | tuple):
        raise ConfigError(f"{key}._args_={args!r} must be a list of positional arguments, e.g. {key}._args_=[1,2].")
    return list(args), {k: v for k, v in node.items() if k not in _HYDRA_KEYS}


def _check_nested(node: Any, key: str) -> None:
    """Every nested `_target_` imports and accepts its `_args_` and kwargs, before anything is built."""
    if isinstance(node, Mapping):
        if "_target_" in node:
            args, kwargs = _split(node, key)
            _check_call(_locate(node["_target_"], key, "callable"), args, kwargs, key, bool(node.get("_partial_")))
        if node.get("_recursive_", True) is False:
            return  # Hydra passes this node's children as they are
        for k, v in node.items():
            if k == "_args_":
                for i, arg in enumerate(v):
                    _check_nested(arg, f"{key}._args_[{i}]")
            elif k not in _HYDRA_KEYS:
                _check_nested(v, f"{key}.{k}")
    elif isinstance(node, list | tuple):
        for i, item in enumerate(node):
            _check_nested(item, f"{key}[{i}]")


def _arguments(*args: Any, **kwargs: Any) -> tuple[list, dict]:
    return list(args), kwargs


def _build_arguments(env_cfg: dict) -> tuple[list, dict]:
    """The env's constructor arguments, built by hydra.utils.instantiate (nested `_target_`, `_partial_`,
    `_args_`, `_convert_`, `_recursive_`). The env class itself is called by load_env: a class given as an
    object (a notebook's, a local one) keeps its identity and is never looked up again by name."""
    from hydra.utils import instantiate

    node = {"_target_": f"{__name__}._arguments", "_convert_": "all", **env_cfg}
    try:
        return instantiate(node)
    except Exception as e:  # InstantiationException, or TypeError for a malformed _partial_/_recursive_ flag
        message = str(e)
        full_key = re.search(r"full_key: (\S+)", message)
        where = _our_key_names(env_cfg).get(full_key.group(1), f"env.{full_key.group(1)}") if full_key else "env"
        cause = e.__cause__ if isinstance(e.__cause__, Exception) else None
        what = f"{cause.__class__.__name__}: {cause}" if cause else message.splitlines()[0]
        target = re.search(r"target '([^']+)'", message)
        raise ConfigError(
            f"{where}: building {target.group(1) if target else 'it'} raised {what}. Fix the config under {where}."
        ) from e


def _our_key_names(env_cfg: dict) -> dict[str, str]:
    """OmegaConf's full key of each nested node -> ours: OmegaConf calls env.options[0] 'options0'."""
    from omegaconf import OmegaConf

    names = {}

    def walk(node: Any, key: str) -> None:
        keys = node.keys() if OmegaConf.is_dict(node) else range(len(node)) if OmegaConf.is_list(node) else []
        for k in keys:
            child = node._get_node(k)
            if OmegaConf.is_config(child):
                names[child._get_full_key(None)] = f"{key}[{k}]" if isinstance(k, int) else f"{key}.{k}"
                walk(child, names[child._get_full_key(None)])

    walk(OmegaConf.create(env_cfg, flags={"allow_objects": True}), "env")
    return names


def load_env(env_cfg: Mapping, env: Any = None, launch_dir: str | os.PathLike | None = None) -> Any:
    """Instantiate the env from its config node: {_target_: ..., **constructor_kwargs}.
    `env`, when given, is an env class (instantiated with the node's kwargs) or a ready instance.
    Modules are imported from `launch_dir` (default: the working directory) and installed packages."""
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
    if env_cfg.get("_partial_", False) is not False:
        raise ConfigError(
            f"env._partial_={env_cfg['_partial_']!r}: the env must be built, not left as a partial. Remove "
            "env._partial_ (a nested kwarg may set it, e.g. env.scorer._partial_=true gives the env a callable)."
        )
    with importable_from(launch_dir):
        cls = resolve_env_class(target)
        check_env_class(cls)
        args, kwargs = _split(env_cfg, "env")
        check_env_kwargs(cls, kwargs, args)
        if env_cfg.get("_recursive_", True) is not False:
            for key, value in kwargs.items():
                _check_nested(value, f"env.{key}")
            for i, value in enumerate(args):
                _check_nested(value, f"env._args_[{i}]")
        built_args, built_kwargs = _build_arguments(env_cfg)
        try:
            return cls(*built_args, **built_kwargs)
        except Exception as e:
            names = ", ".join(f"{k}={MASK if is_secret_key(k) and looks_secret(v) else _short(v)}"
                              for k, v in kwargs.items())
            shown = f"*{len(args)} positional, {names}" if args else names
            raise ConfigError(
                f"env: {cls.__qualname__}({shown}) raised {e.__class__.__name__}: {mask_secrets(str(e))}. "
                "Fix the constructor kwargs under env."
            ) from e


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."



def takes_episode_seed(env: Any, method: str) -> bool:
    """Whether `env.<method>` (respond, score_turn, score_episode) declares a parameter named `episode_seed`: the
    runtime passes it only then (a training episode's own seed; None in held-out evaluation)."""
    fn = getattr(env, method, None)
    if not callable(fn):
        return False
    try:
        return "episode_seed" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def build_env_dataset(env: Any, tokenizer) -> Dataset:
    name = env_name(env)
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
    clashes = [c for c in dataset.column_names if c in RESERVED_COLUMNS]
    if clashes:
        renames = ", ".join(f"'{c}' -> '{c}_ref'" for c in clashes)
        raise ConfigError(
            f"{name}.build_dataset returned column(s) {clashes}, whose names are taken: columns reach "
            f"score_episode as keyword arguments beside model, tokenizer and completion (and TRL's reward arguments). "
            f"Rename them, e.g. dataset.rename_columns({{{renames}}}) (a reference answer: 'reference')."
        )
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
                f"{env_name(env)}.get_tools()[{i}] is not an OpenAI function schema "
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
    name = env_name(env)
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
