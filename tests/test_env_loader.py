"""Startup validation of a user's env: each failure is one clear message naming the class/key and the fix."""

import textwrap

import pytest
from datasets import Dataset

from grpo_pipeline.envs.loader import build_env_dataset, get_tool_schemas, load_env
from grpo_pipeline.errors import ConfigError


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Write my_envs/<name>.py under tmp_path and make tmp_path the working directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_envs").mkdir()
    (tmp_path / "my_envs" / "__init__.py").write_text("")

    def _write(name: str, source: str) -> str:
        (tmp_path / "my_envs" / f"{name}.py").write_text(textwrap.dedent(source))
        return f"my_envs.{name}"

    yield _write
    import sys

    for mod in [m for m in sys.modules if m.startswith("my_envs")]:
        del sys.modules[mod]


GOOD = """
from datasets import Dataset
class Good:
    def __init__(self, max_turns=3, difficulty="normal"):
        self.max_turns, self.difficulty = max_turns, difficulty
    def build_dataset(self, tokenizer):
        return Dataset.from_list([{"prompt": "hi", "answer": 1}])
    def score_episode(self, model, tokenizer, completion, answer):
        return 1.0
"""


def test_user_env_from_working_directory(user_module):
    mod = user_module("good", GOOD)
    env = load_env({"_target_": f"{mod}.Good", "max_turns": 5})
    assert (env.max_turns, env.difficulty) == (5, "normal")
    assert build_env_dataset(env, None).column_names == ["prompt", "answer"]


@pytest.mark.parametrize(
    ("target", "kwargs", "expected"),
    [
        (None, {}, "env._target_ is missing"),
        ("NoDots", {}, "is not a dotted path"),
        ("my_envs.nope.Env", {}, "module 'my_envs.nope' cannot be imported"),
        ("my_envs.good.Missing", {}, "has no class 'Missing'. Classes defined there: ['Good']"),
        ("my_envs.good.Good", {"max_turn": 2}, "does not accept the config's kwargs ['max_turn']"),
    ],
)
def test_bad_target_or_kwargs(user_module, target, kwargs, expected):
    user_module("good", GOOD)
    cfg = dict(kwargs) | ({"_target_": target} if target else {})
    with pytest.raises(ConfigError) as e:
        load_env(cfg)
    assert expected in str(e.value)


def test_module_that_fails_to_import(user_module):
    mod = user_module("broken", "raise RuntimeError('boom at import')\n")
    with pytest.raises(ConfigError, match="importing module 'my_envs.broken' raised RuntimeError: boom at import"):
        load_env({"_target_": f"{mod}.Env"})


def test_missing_methods(user_module):
    mod = user_module("half", "class Half:\n    def build_dataset(self, tokenizer): ...\n")
    with pytest.raises(ConfigError, match="Half lacks score_episode"):
        load_env({"_target_": f"{mod}.Half"})


def test_constructor_that_raises(user_module):
    mod = user_module("strict", GOOD.replace("self.max_turns, self.difficulty", "assert max_turns < 9; self.max_turns, self.difficulty"))
    with pytest.raises(ConfigError, match=r"Good\(\*\*\{'max_turns': 10\}\) raised AssertionError"):
        load_env({"_target_": f"{mod}.Good", "max_turns": 10})


class _Env:
    def __init__(self, dataset):
        self.dataset = dataset

    def build_dataset(self, tokenizer):
        return self.dataset

    def score_episode(self, model, tokenizer, completion, **kw):
        return 0.0


@pytest.mark.parametrize(
    ("dataset", "expected"),
    [
        ([{"prompt": "x"}], "returned list; return a datasets.Dataset"),
        (Dataset.from_list([{"question": "x"}]), "columns ['question'] without 'prompt'"),
        (Dataset.from_list([{"prompt": "ok"}, {"prompt": ""}]), "row 1 has prompt ''"),
        (Dataset.from_dict({"prompt": []}), "returned an empty dataset"),
    ],
)
def test_bad_datasets(dataset, expected):
    with pytest.raises(ConfigError) as e:
        build_env_dataset(_Env(dataset), None)
    assert expected in str(e.value) and "_Env" in str(e.value)


def test_chat_prompts_accepted():
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": "hi"}], "x": 1}])
    assert len(build_env_dataset(_Env(ds), None)) == 1


def test_bad_tool_schema():
    env = _Env(None)
    env.get_tools = lambda: [{"type": "function", "function": {"description": "no name"}}]
    with pytest.raises(ConfigError, match=r"get_tools\(\)\[0\] is not an OpenAI function schema"):
        get_tool_schemas(env)


def test_tool_functions_need_a_template_that_renders_tool_calls():
    from grpo_pipeline.envs.loader import get_tool_functions
    from grpo_pipeline.models import build_tiny_tokenizer

    def search_rooms(city: str) -> str:
        """Search rooms.

        Args:
            city: The city.
        """
        return "[]"

    env = _Env(None)
    env.get_tool_functions = lambda: [search_rooms]
    with pytest.raises(ConfigError, match=r"_Env.get_tool_functions\(\) gives tools for TRL's tool loop, but the "
                                          "model's chat template cannot render tool calls"):
        get_tool_functions(env, build_tiny_tokenizer())
    env.get_tool_functions = lambda: [lambda city: city]
    with pytest.raises(ConfigError, match="must be a callable with type hints and a Google-style docstring"):
        get_tool_functions(env, build_tiny_tokenizer())
    assert get_tool_functions(_Env(None), build_tiny_tokenizer()) == []


TOOL_ENV = '''
from datasets import Dataset


def search_rooms(city: str) -> str:
    """Search the rooms of a city.

    Args:
        city: The city to search.
    """
    return '[{"room_id": "LIS-101"}]'


class ToolEnv:
    def build_dataset(self, tokenizer):
        return Dataset.from_list([{"prompt": [{"role": "user", "content": "Find a room in Lisbon"}]}] * 8)

    def get_tool_functions(self):
        return [search_rooms]

    def score_episode(self, model, tokenizer, completion):
        return 1.0 if "LIS-101" in completion else 0.0
'''


def test_tool_functions_are_wired_into_trl(tmp_path, monkeypatch, compose_cfg):
    from conftest import tiny_overrides
    from grpo_pipeline.recipe import train

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tool_env.py").write_text(TOOL_ENV)
    cfg = compose_cfg([*tiny_overrides(tmp_path, ["env=custom", "env._target_=tool_env.ToolEnv"]),
                       "model.chat_template=trl:qwen2_5",
                       "training.max_steps=1"])
    result = train(cfg, launch_dir=str(tmp_path))
    assert result.steps == 1
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run(result.mlflow_run_id)
    assert "tools/call_frequency" in run.data.metrics  # TRL's tool loop ran with the env's tools
