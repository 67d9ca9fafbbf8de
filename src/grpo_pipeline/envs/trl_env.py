"""TRL's `environment_factory` envs run here unchanged: `env=trl env.factory=my_module.MyEnv`.

What a TRL user wrote (TRL 1.16, GRPOTrainer(environment_factory=...)): a class (or zero-argument factory)
whose instances have `reset(**row) -> str | None`, public methods that are the model's tools (their schemas built
from type hints and Google-style docstrings, as TRL builds them) and `get_reward() -> float` (sync or async).
`TRLEnv` wraps it into this project's env contract, with TRL's semantics:

- one instance per episode, drawn from a pool (construct once, reset often); `reset` gets the dataset row (its
  `prompt` and columns, those its signature takes) and what it returns is appended to the prompt's last message;
- the runtime samples each assistant turn (rollout/turns.py); the tool calls it wrote (`<tool_call>{json}
  </tool_call>`, the format of the tools preamble and of Qwen's template) are run on the episode's instance, one
  tool message per call (`{"error": ...}` for an unknown tool or one that raised), and the next turn follows; a turn
  without a (well-formed) tool call ends the episode, as in TRL; `max_turns` bounds it;
- the episode's score is its instance's `get_reward()`, mapped from `reward_range` to [0, 1].

The opening prompts come from a dataset the user names (`dataset`: a dotted path to a `datasets.Dataset`, a list
of rows or a function returning one; or a .json/.jsonl/.csv/.parquet file) or, for an env whose `reset()` writes the
task, `num_episodes` rows (when no dataset is named) of an empty user message with an `episode` column (0..N-1) that
`reset` may take to seed its task, so that a GRPO group's completions play the same task (checked at start-up). Rows
with an `episode` column are held out by it, not by their prompt.

An episode recorded in the ledger is scored again (rescore) by replay: a fresh instance, `reset(**row)`, the
recorded tool calls run again, `get_reward()`; a tool result that differs from the recorded one says the env is
not deterministic given its row, and that episode cannot be re-scored.
"""

import asyncio
import importlib
import inspect
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from datasets import Dataset, load_dataset

from grpo_pipeline.envs.runner import as_real
from grpo_pipeline.errors import ConfigError
from grpo_pipeline.prompts import parse_tool_calls

log = logging.getLogger(__name__)

_NOT_TOOLS = ("reset", "get_reward")
_FILE_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


class TRLEnv:
    thread_safe = True  # every episode has its own instance

    def __init__(self, factory: Any, dataset: Any = None, num_episodes: int | None = None, max_turns: int = 5,
                 turn_max_new_tokens: int = 96, factory_kwargs: dict | None = None, system_prompt: str | None = None,
                 reward_range: tuple[float, float] | list[float] = (0.0, 1.0)):
        if dataset is None and num_episodes is None:
            raise ValueError("set env.dataset (where the opening prompts come from) or env.num_episodes (how many "
                             "episodes, for an env whose reset() writes the task)")
        if dataset is not None:
            num_episodes = None  # a named dataset replaces the generated rows
        elif int(num_episodes) < 1:
            raise ValueError(f"env.num_episodes={num_episodes}: give a positive number of episodes")
        if max_turns < 1:
            raise ValueError(f"env.max_turns={max_turns}: an episode has at least one assistant turn")
        low, high = (float(x) for x in reward_range)
        if not high > low:
            raise ValueError(f"env.reward_range={list(reward_range)}: give [min, max] with max > min")
        self.make = _factory(factory, dict(factory_kwargs or {}))
        self._source = _dataset_source(dataset)
        self.name = getattr(factory, "__qualname__", None) or str(factory).rsplit(".", 1)[-1]
        self.display_name = f"TRLEnv({self.name})"  # how the pipeline's messages name the env
        self.dataset, self.num_episodes, self.system_prompt = dataset, num_episodes, system_prompt
        self.max_turns, self.turn_max_new_tokens = int(max_turns), int(turn_max_new_tokens)
        self.reward_range = (low, high)
        # rows with an `episode` column (generated ones share one prompt) are split by it, not by their prompt
        # (the held-out split, evaluation/heldout.py); decided by build_dataset
        self.prompt_is_task, self.heldout_group_by = True, []
        probe = self.make()
        self.cls = type(probe)
        if not callable(getattr(probe, "reset", None)):
            raise ConfigError(f"env.factory={self.name}: its instances have no reset() method. A TRL environment "
                              "defines reset(self, **kwargs) -> str | None (called at the start of each episode).")
        if not callable(getattr(probe, "get_reward", None)):
            raise ConfigError(f"env.factory={self.name}: its instances have no get_reward() method. Here a TRL "
                              "environment's reward is its get_reward(self) -> float (read from the instance's state "
                              "at the end of the episode); add one (reward functions reading `environments` are not "
                              "supported).")
        self.tool_names = [name for name, _ in inspect.getmembers(self.cls, predicate=inspect.isfunction)
                           if name not in _NOT_TOOLS and not name.startswith("_")]
        if not self.tool_names:
            raise ConfigError(f"env.factory={self.name}: no public method to use as a tool (TRL's rule: every public "
                              "method but reset and get_reward is a tool).")
        self.schemas = [_schema(getattr(probe, name), self.name) for name in self.tool_names]
        self._pool, self._lock = [probe], threading.Lock()
        self.same_task_in_group: bool | None = None  # decided by build_dataset's probe (None: cannot tell)

    # --- the env contract ------------------------------------------------------------------------------
    def get_tools(self) -> list[dict]:
        return self.schemas

    def build_dataset(self, tokenizer) -> Dataset:
        if self.num_episodes is not None:
            opening = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + [
                {"role": "user", "content": ""}]
            dataset = Dataset.from_list([{"prompt": opening, "episode": i} for i in range(int(self.num_episodes))])
        else:
            dataset = _load_dataset(self._source, self.dataset)
        if "episode" in dataset.column_names:
            self.prompt_is_task, self.heldout_group_by = False, ["episode"]
        if len(dataset) and "prompt" in dataset.column_names:
            self.same_task_in_group = self._probe_groups(dataset[0])
        return dataset

    def start_episode(self, prompt, **row) -> tuple[Any, "Session"]:
        """The episode's instance (from the pool), reset with its row; the opening with reset()'s text appended."""
        instance = self._take()
        observation = _call(instance.reset, **_accepted(instance.reset, {"prompt": prompt, **row}))
        return _appended(prompt, observation, self.name), Session(self, instance)

    def respond(self, messages: list[dict], **row) -> list[dict] | None:
        raise RuntimeError(f"{self.name}: a TRL environment's turns are answered by its episode's instance "
                           "(start_episode); respond() without one has no state to act on.")

    def score_episode(self, model, tokenizer, completion, **row) -> float:
        """The episode's get_reward(): from its live instance (training, evaluation, the doctor), else by replay."""
        session = getattr(completion, "session", None)
        if session is not None:
            return session.score()
        return self.replay(completion, row)

    def episode_metrics(self, completion: list[dict], **row) -> dict[str, float]:
        """Logged per step as env/<name> (batch means)."""
        parsed = [parse_tool_calls(str(m.get("content") or "")) for m in completion if m.get("role") == "assistant"]
        errors = sum(_is_error(m.get("content")) for m in completion if m.get("role") == "tool")
        return {"tool_calls": float(sum(len(p) for p in parsed if p)),
                "malformed_tool_calls": float(sum(p is None for p in parsed)), "tool_errors": float(errors)}

    def env_style(self) -> str:
        """What the doctor says of the env."""
        groups = {True: "yes", False: "NO: reset() gives the same row different tasks, so a group's completions "
                  "face different tasks and GRPO's group baseline compares unlike episodes (seed the task with the "
                  "row's `episode`, or name a dataset)", None: "cannot tell (reset() returns no text)"}
        return (f"env style: TRL environment {self.name} (environment_factory): tools {', '.join(self.tool_names)}; "
                f"reward get_reward() mapped from {list(self.reward_range)}; every assistant turn is trained, the "
                f"tool results are masked out of the loss; one group, one task: {groups[self.same_task_in_group]}")

    # --- episodes --------------------------------------------------------------------------------------
    def run_tools(self, instance: Any, text: str) -> list[dict] | None:
        """The tool messages for the calls in an assistant turn (TRL's format); None when it made no call."""
        calls = parse_tool_calls(text)
        if not calls:
            return None
        replies = []
        for call in calls:
            name = str(call.get("name"))
            try:
                if name not in self.tool_names:
                    raise ValueError(f"Tool {name} not found.")
                result = _call(getattr(instance, name), **call.get("arguments", {}))
            except Exception as e:  # a tool's error goes back to the model, as in TRL
                result = {"error": str(e)}
            replies.append({"role": "tool", "name": name, "content": str(result)})
        return replies

    def reward(self, instance: Any) -> float:
        value = _call(instance.get_reward)
        number = as_real(value)
        if number is None:
            raise TypeError(f"{self.name}.get_reward() returned {value!r}; return a float")
        low, high = self.reward_range
        return (number - low) / (high - low)

    def replay(self, messages: list[dict], row: dict) -> float:
        """The score of a recorded episode: a fresh instance replays it (reset, then each assistant turn's tool calls
        that the transcript shows the env answered), checking every tool result against the recorded one."""
        instance = self.make()
        _call(instance.reset, **_accepted(instance.reset, row))
        for k, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            recorded = []
            for later in messages[k + 1:]:
                if later.get("role") != "tool":
                    break
                recorded.append(str(later.get("content")))
            if not recorded:
                continue  # the env did not answer this turn (the episode ended, or was cut)
            replayed = [m["content"] for m in self.run_tools(instance, str(message.get("content") or "")) or []]
            if replayed != recorded:
                raise ValueError(f"{self.name}: replaying the recorded episode (reset(**row), then its tool calls) "
                                 f"gave tool results {replayed} where the episode recorded {recorded}: the env is not "
                                 "deterministic given its row, so this episode cannot be scored again from its "
                                 "transcript.")
        return self.reward(instance)

    def _take(self) -> Any:
        with self._lock:
            return self._pool.pop() if self._pool else self.make()

    def _give_back(self, instance: Any) -> None:
        with self._lock:
            self._pool.append(instance)

    def _probe_groups(self, row: dict) -> bool | None:
        """Whether reset() gives one row the same task twice (two fresh instances)."""
        instances = [self.make(), self.make()]
        try:
            seen = [_call(i.reset, **_accepted(i.reset, row)) for i in instances]
        except Exception as e:
            raise ConfigError(f"env.factory={self.name}: reset(**row) raised {e.__class__.__name__}: {e} on the "
                              f"dataset's first row {_short(row)}. Fix reset, or the row's columns.") from e
        self._pool += instances  # construct once, reset often
        if seen[0] is None and seen[1] is None:
            return None
        same = seen[0] == seen[1]
        if not same:
            log.warning("%s.reset() gives the same row different tasks: the completions of a GRPO group face "
                        "different tasks. Seed the task with the row's `episode` (env.num_episodes) or a column.",
                        self.name)
        return same


class Session:
    """One episode's instance: answers its turns, gives its reward once, then goes back to the pool."""

    def __init__(self, env: TRLEnv, instance: Any):
        self.env, self.instance, self.value = env, instance, None

    def respond(self, messages: list[dict]) -> list[dict] | None:
        if self.instance is None:
            raise RuntimeError(f"{self.env.name}: this episode was already scored; its instance serves another one.")
        return self.env.run_tools(self.instance, str(messages[-1].get("content") or ""))

    def score(self) -> float:
        if self.value is None:
            if self.instance is None:
                raise RuntimeError(f"{self.env.name}: this episode's instance is gone (its scoring failed before).")
            instance, self.instance = self.instance, None
            self.value = self.env.reward(instance)
            self.env._give_back(instance)
        return self.value


def _factory(factory: Any, kwargs: dict) -> Callable[[], Any]:
    if isinstance(factory, str):
        module_name, _, name = factory.rpartition(".")
        if not module_name:
            raise ConfigError(f"env.factory={factory!r} is not a dotted path. Set it to 'package.module.ClassName'.")
        try:
            module = importlib.import_module(module_name)
        except Exception as e:
            raise ConfigError(f"env.factory={factory!r}: importing module '{module_name}' raised "
                              f"{e.__class__.__name__}: {e}. Check the spelling, and that it lies under the directory "
                              f"you launch from ({os.getcwd()}) or is installed.") from e
        found = getattr(module, name, None)
        if not callable(found):
            raise ConfigError(f"env.factory={factory!r}: module '{module_name}' has no class or function '{name}'.")
        factory = found
    if not callable(factory):
        raise ConfigError(f"env.factory={factory!r}: give a class or a zero-argument function returning an instance.")

    def make():
        try:
            return factory(**kwargs)
        except Exception as e:
            raise ConfigError(f"env.factory: {getattr(factory, '__qualname__', factory)}(**{kwargs}) raised "
                              f"{e.__class__.__name__}: {e}. Fix env.factory_kwargs.") from e

    return make


def _schema(method: Callable, env_name: str) -> dict:
    """The tool's OpenAI schema, built as TRL builds it (transformers' get_json_schema)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(method)
    except Exception as e:
        raise ConfigError(f"{env_name}.{method.__name__} is a tool (a public method) but its schema cannot be built: "
                          f"{e}. Give it type hints and a Google-style docstring with an Args section, as TRL "
                          "requires, or make it private (_name).") from e


def _dataset_source(spec: Any) -> Any:
    """env.dataset, resolved while the launch directory is importable (the constructor): a file path, or the
    object a dotted path names (a Dataset, a list of rows, or a function returning either)."""
    if spec is None or not isinstance(spec, str):
        return spec
    if os.path.splitext(spec)[1] in _FILE_FORMATS:
        if not os.path.exists(spec):
            raise ConfigError(f"env.dataset={spec!r}: no such file (relative paths start at {os.getcwd()}).")
        return os.path.abspath(spec)
    module_name, _, name = spec.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except Exception as e:
        raise ConfigError(f"env.dataset={spec!r}: not a .json/.jsonl/.csv/.parquet file and not an importable "
                          f"dotted path ({e.__class__.__name__}: {e}). Name a file, or module.rows / "
                          "module.make_rows (no download: datasets come from this machine)") from e


def _load_dataset(source: Any, spec: Any) -> Dataset:
    if isinstance(source, str):  # a file
        return load_dataset(_FILE_FORMATS[os.path.splitext(source)[1]], data_files=source, split="train")
    found = source() if callable(source) and not isinstance(source, Dataset) else source
    if isinstance(found, list):
        found = Dataset.from_list(found)
    if not isinstance(found, Dataset):
        raise ConfigError(f"env.dataset={spec!r} gave {type(found).__name__}; give a datasets.Dataset or a list of "
                          "rows with a 'prompt'.")
    return found


def _call(fn: Callable, *args, **kwargs) -> Any:
    """A sync or async method's result (an async one runs to completion on its own event loop)."""
    result = fn(*args, **kwargs)
    return asyncio.run(result) if inspect.iscoroutine(result) else result


def _accepted(fn: Callable, kwargs: dict) -> dict:
    """The keyword arguments `fn` takes (all of them when it has **kwargs)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return kwargs
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in kwargs.items() if k in names}


def _appended(prompt: Any, observation: Any, name: str) -> Any:
    """TRL's rule: reset()'s text is appended to the last message's content (a text prompt: to the prompt)."""
    if observation is None:
        return prompt
    if not isinstance(observation, str):
        raise TypeError(f"{name}.reset() returned {type(observation).__name__}; return a string (appended to the "
                        "prompt) or None")
    if isinstance(prompt, str):
        return prompt + observation
    return [*prompt[:-1], {**prompt[-1], "content": str(prompt[-1].get("content") or "") + observation}]


def _is_error(content: Any) -> bool:
    return isinstance(content, str) and content.startswith("{'error': ")  # str() of run_tools' error result


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
