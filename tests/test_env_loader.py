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
    with pytest.raises(ConfigError, match=r"Good\(max_turns=10\) raised AssertionError"):
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


PARTS = """
from datasets import Dataset


class Scorer:
    def __init__(self, bonus, scale=1.0):
        if bonus < 0:
            raise ValueError("bonus must be >= 0")
        self.bonus, self.scale = bonus, scale


def clip(x, low, high):
    return max(low, min(high, x))


class Composed:
    def __init__(self, name, rounds, scorer=None, clip_fn=None, options=None):
        self.name, self.rounds, self.scorer, self.clip_fn, self.options = name, rounds, scorer, clip_fn, options

    def build_dataset(self, tokenizer):
        return Dataset.from_list([{"prompt": self.name}])

    def score_episode(self, model, tokenizer, completion):
        return self.clip_fn(self.scorer.bonus * self.scorer.scale)
"""


def test_nested_targets_args_and_partials_are_instantiated(user_module):
    mod = user_module("parts", PARTS)
    env = load_env({
        "_target_": f"{mod}.Composed",
        "_args_": ["hotel", 3],
        "scorer": {"_target_": f"{mod}.Scorer", "bonus": 0.5, "scale": 4},
        "clip_fn": {"_target_": f"{mod}.clip", "_partial_": True, "low": 0.0, "high": 1.0},
        "options": {"cities": ["Porto", "Lisbon"]},
    })
    import sys

    parts = sys.modules[mod]
    assert (env.name, env.rounds) == ("hotel", 3)
    assert type(env.scorer) is parts.Scorer and (env.scorer.bonus, env.scorer.scale) == (0.5, 4)
    assert env.clip_fn(5) == 1.0 and env.clip_fn(-2) == 0.0 and env.score_episode(None, None, "") == 1.0
    assert type(env.options) is dict and type(env.options["cities"]) is list  # plain containers, as before


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        ({"_args_": ["a", 1, 2, 3, 4, 5]}, "env: Composed does not accept the config's _args_ ['a', 1, 2, 3, 4, 5]"),
        ({"_args_": "a"}, "env._args_='a' must be a list"),
        ({"_args_": ["a", 1], "_partial_": True}, "env._partial_=True: the env must be built, not left as a partial"),
        ({"_args_": ["a", 1], "scorer": {"_target_": "my_envs.nope.Scorer"}},
         "env.scorer._target_='my_envs.nope.Scorer': module 'my_envs.nope' cannot be imported"),
        ({"_args_": ["a", 1], "scorer": {"_target_": "my_envs.parts.Nope"}},
         "env.scorer._target_='my_envs.parts.Nope': module 'my_envs.parts' has no callable 'Nope'. "
         "Classes defined there: ['Composed', 'Scorer']"),
        ({"_args_": ["a", 1], "scorer": {"_target_": "my_envs.parts.Scorer", "bonus": 1, "bonnus": 2}},
         "env.scorer: Scorer does not accept the config's kwargs ['bonnus', 'bonus']"),
        ({"_args_": ["a", 1], "scorer": {"_target_": "my_envs.parts.Scorer"}},
         "env.scorer: Scorer does not accept the config's kwargs []"),
        ({"_args_": ["a", 1], "clip_fn": {"_target_": "my_envs.parts.clip", "_partial_": True, "hi": 1}},
         "env.clip_fn: clip does not accept the config's kwargs ['hi']"),
        ({"_args_": ["a", 1], "options": [{"_target_": "my_envs.parts.Scorer", "bonus": -1}]},
         "env.options[0]: building my_envs.parts.Scorer raised ValueError: bonus must be >= 0"),
        ({"_args_": ["a", {"_target_": "my_envs.parts.Scorer", "bonus": -1}]},
         "env._args_[1]: building my_envs.parts.Scorer raised ValueError: bonus must be >= 0"),
        ({"_args_": ["a", 1], "scorer": {"_target_": "my_envs.parts.Scorer", "bonus": -1}},
         "env.scorer: building my_envs.parts.Scorer raised ValueError: bonus must be >= 0"),
    ],
)
def test_bad_nested_targets_and_args(user_module, cfg, expected):
    user_module("parts", PARTS)
    with pytest.raises(ConfigError) as e:
        load_env({"_target_": "my_envs.parts.Composed", **cfg})
    assert expected in str(e.value)


def test_env_given_as_a_local_class_keeps_its_identity():
    class LocalEnv(_Env):  # not importable by name: built by calling the class itself
        def __init__(self, dataset, scorer):
            super().__init__(dataset)
            self.scorer = scorer

    env = load_env({"_args_": [[1]], "scorer": {"_target_": "fractions.Fraction", "_args_": [1, 3]}}, LocalEnv)
    from fractions import Fraction

    assert type(env) is LocalEnv and env.dataset == [1] and env.scorer == Fraction(1, 3)


def test_launch_dir_is_importable_only_while_loading(user_module, tmp_path):
    import importlib.util
    import sys

    (tmp_path / "launch_dir_probe.py").write_text("X = 1\n")
    user_module("good", GOOD)
    sys_path = list(sys.path)
    load_env({"_target_": "my_envs.good.Good"})
    assert sys.path == sys_path and str(tmp_path) not in sys.path
    assert importlib.util.find_spec("launch_dir_probe") is None  # it would shadow a package of that name


SAME_NAME = """
from datasets import Dataset
class {cls}:
    def build_dataset(self, tokenizer):
        return Dataset.from_list([{{"prompt": "{cls}"}}])
    def score_episode(self, model, tokenizer, completion):
        return 1.0
"""


def test_same_module_name_in_two_launch_dirs(tmp_path, monkeypatch):
    import sys

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "same_name_env.py").write_text(SAME_NAME.format(cls=f"Env{name.upper()}"))
    try:
        monkeypatch.chdir(tmp_path / "a")
        first = load_env({"_target_": "same_name_env.EnvA"})
        monkeypatch.chdir(tmp_path / "b")
        second = load_env({"_target_": "same_name_env.EnvB"})  # not the module cached from a/
        with pytest.raises(ConfigError, match=r"has no class 'EnvA'. Classes defined there: \['EnvB'\]"):
            load_env({"_target_": "same_name_env.EnvA"})
        third = load_env({"_target_": "same_name_env.EnvA"}, launch_dir=tmp_path / "a")
    finally:
        sys.modules.pop("same_name_env", None)
    assert type(first).__name__ == "EnvA" and type(second).__name__ == "EnvB" and type(third).__name__ == "EnvA"
    assert build_env_dataset(second, None)["prompt"] == ["EnvB"]


LOCAL_DATASETS_ENV = """
from datasets import Dataset
class Env:
    def build_dataset(self, tokenizer):
        return Dataset.from_list([{"prompt": "hi"}])
    def score_episode(self, model, tokenizer, completion):
        return 1.0
"""


def _run_with_local_datasets_py(tmp_path, command):
    import subprocess

    (tmp_path / "datasets.py").write_text("raise ImportError('the local datasets.py shadowed the datasets package')\n")
    (tmp_path / "local_env.py").write_text(LOCAL_DATASETS_ENV)
    # reward=accuracy needs an 'answer' column: a ConfigError right after the env's dataset is built and checked.
    args = ["model=tiny", "env=custom", "env._target_=local_env.Env", "reward=accuracy", "eval.enabled=false",
            f"tracking.tracking_uri=sqlite:///{tmp_path / 'm.db'}"]
    return subprocess.run([*command, *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_local_datasets_py_does_not_shadow_the_package_console_script(tmp_path):
    import sys
    from pathlib import Path

    proc = _run_with_local_datasets_py(tmp_path, [str(Path(sys.prefix) / "bin" / "grpo-pipeline")])
    assert proc.returncode == 2 and "needs dataset column(s) ['answer']" in proc.stderr, proc.stderr[-2000:]


def test_local_datasets_py_does_not_shadow_the_package_python_m(tmp_path):
    import sys

    proc = _run_with_local_datasets_py(tmp_path, [sys.executable, "-m", "grpo_pipeline"])
    assert proc.returncode == 2 and "needs dataset column(s) ['answer']" in proc.stderr, proc.stderr[-2000:]
