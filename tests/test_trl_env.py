"""TRL 1.16 environment_factory envs run unchanged (envs/trl_env.py, env=trl): reset() per episode on its own
instance, public methods as tools run on that instance turn after turn, get_reward() as the score; the ledger,
rescoring (by replay), the doctor and training work on them; mistakes are config errors that name the fix."""

import json
import logging
import random

import pytest

import grpo_pipeline.recipe as recipe
import grpo_pipeline.rollout.turns as turns_module
from conftest import scripted, tiny_overrides
from grpo_pipeline.config.schema import ModelConfig, RuntimeConfig
from grpo_pipeline.envs.guess import GuessNumber
from grpo_pipeline.envs.runner import EpisodeRunner
from grpo_pipeline.envs.trl_env import TRLEnv
from grpo_pipeline.errors import ConfigError
from grpo_pipeline.models import build_tiny_model, build_tiny_tokenizer
from grpo_pipeline.rollout.turns import Rollout

SAMPLING = {"do_sample": True, "temperature": 0.9, "top_k": 0, "top_p": 1.0}


def _call(number) -> str:
    return f'<tool_call>{json.dumps({"name": "guess", "arguments": {"number": number}})}</tool_call>'


def _secret(episode: int, high: int = 20) -> int:
    return random.Random(episode).randint(1, high)


def _plan(episodes):
    """Episode i guesses 10, then its secret, then writes no call (the episode ends)."""
    return lambda i, turn: _call(10) if turn == 0 else _call(_secret(episodes[i])) if turn == 1 else "done"


@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_tiny_tokenizer()
    tokenizer.padding_side = "left"
    return tokenizer, build_tiny_model(ModelConfig(name="tiny", source="tiny"), tokenizer)


def _rollout(tiny, env):
    tokenizer, model = tiny
    runner = EpisodeRunner(env, tokenizer, RuntimeConfig(), ["episode"])
    runner.bind(model)
    rollout = Rollout(env, tokenizer, runner, max_turns=env.max_turns, turn_tokens=64, max_episode_tokens=1024,
                      tools=env.get_tools())
    return rollout, runner


def test_each_episode_plays_its_own_instance_turn_after_turn(tiny, monkeypatch):
    tokenizer, model = tiny
    env = TRLEnv(GuessNumber, num_episodes=8, max_turns=4)
    data = env.build_dataset(tokenizer)
    assert env.same_task_in_group is True  # GuessNumber seeds its secret with the row's episode
    rollout, runner = _rollout(tiny, env)
    episodes = [3, 5, 6]
    monkeypatch.setattr(turns_module, "generate", scripted(tokenizer, _plan(episodes)))
    trajs = rollout.run(model, [data[e]["prompt"] for e in episodes], [{"episode": e} for e in episodes], SAMPLING)
    for t, e in zip(trajs, episodes, strict=True):
        secret = _secret(e)
        # reset()'s text is appended to the opening, and the model sees it
        assert "I am thinking of a whole number from 1 to 20" in t.prompt[-1]["content"]
        assert "I am thinking of a whole number" in tokenizer.decode(t.prompt_ids)
        roles = [m["role"] for m in t.messages]
        first = "correct" if secret == 10 else "higher" if secret > 10 else "lower"
        if secret == 10:
            assert roles == ["assistant", "tool", "assistant", "tool", "assistant"]
        assert [m["content"] for m in t.messages if m["role"] == "tool"] == [first, "correct"]
        assert t.turns == 3 and t.done  # the third turn made no call: the episode is over
        # the tool results are the env's tokens: masked out of the loss
        env_text = tokenizer.decode([i for i, m in zip(t.completion_ids, t.env_mask, strict=True) if not m])
        assert "correct" in env_text and "guess" not in env_text.replace("<|im_start|>tool", "")
        assert t.messages.session.instance.guesses == [10, secret]  # state kept across the turns
    scores, _ = runner.score([t.messages for t in trajs], [{"episode": e} for e in episodes])
    expected = [1.0 if _secret(e) == 10 else 0.9 for e in episodes]
    assert scores == pytest.approx(expected)
    # the instances went back to the pool; a recorded transcript (a plain list) scores the same by replay
    assert all(t.messages.session.instance is None for t in trajs) and len(env._pool) >= len(episodes)
    assert [env.replay(list(t.messages), {"episode": e}) for t, e in zip(trajs, episodes, strict=True)] == \
        pytest.approx(expected)


class Counter:
    """A TRL-style env with an async tool, a tool that raises, and an async reward in [-1, 1]."""

    made = 0

    def __init__(self, start: int = 0):
        Counter.made += 1
        self.start, self.value = start, start

    def reset(self, **kwargs) -> str:
        self.value = self.start
        return f" (counter at {self.value})"

    async def add(self, amount: int) -> int:
        """Add to the counter.

        Args:
            amount: How much to add.
        """
        self.value += amount
        return self.value

    def explode(self) -> str:
        """Always fails."""
        raise RuntimeError("kaboom")

    async def get_reward(self) -> float:
        return 1.0 if self.value == 3 else -1.0

    def _private(self):
        return "not a tool"


def test_tools_async_methods_errors_and_the_reward_range():
    env = TRLEnv(Counter, num_episodes=2, reward_range=[-1, 1], factory_kwargs={"start": 1})
    assert env.tool_names == ["add", "explode"]  # public methods but reset / get_reward: TRL's rule
    assert env.get_tools()[0]["function"]["parameters"]["properties"]["amount"]["type"] == "integer"
    prompt, session = env.start_episode([{"role": "user", "content": "Count."}], episode=0)
    assert prompt == [{"role": "user", "content": "Count. (counter at 1)"}]  # appended, as TRL does
    text = _call(0).replace("guess", "add").replace('"number": 0', '"amount": 2') + \
        '<tool_call>{"name": "explode", "arguments": {}}</tool_call><tool_call>{"name": "fly", "arguments": {}}' \
        "</tool_call>"
    replies = session.respond([{"role": "assistant", "content": text}])
    assert replies == [{"role": "tool", "name": "add", "content": "3"},
                       {"role": "tool", "name": "explode", "content": "{'error': 'kaboom'}"},
                       {"role": "tool", "name": "fly", "content": "{'error': 'Tool fly not found.'}"}]
    assert session.respond([{"role": "assistant", "content": "no call"}]) is None  # the episode ends, as in TRL
    assert session.respond([{"role": "assistant", "content": "<tool_call>{bad json</tool_call>"}]) is None
    assert session.score() == 1.0 and session.score() == 1.0  # get_reward 1.0 in [-1, 1] -> 1.0; asked once
    metrics = env.episode_metrics([{"role": "assistant", "content": text}, *replies])
    assert metrics == {"tool_calls": 3.0, "malformed_tool_calls": 0.0, "tool_errors": 2.0}


def test_a_text_prompt_gets_the_reset_text_and_instances_are_reused():
    Counter.made = 0
    env = TRLEnv(Counter, num_episodes=1)
    made = Counter.made
    for _ in range(3):  # construct once, reset often
        prompt, session = env.start_episode("Count.")
        assert prompt == "Count. (counter at 0)"
        session.score()
    assert Counter.made == made


class Unseeded(GuessNumber):
    def reset(self, **kwargs) -> str:
        self.secret = random.randint(1, 10**9)
        return f"secret {self.secret}"


def test_a_reset_that_gives_one_row_different_tasks_is_flagged(caplog):
    env = TRLEnv(Unseeded, num_episodes=4)
    with caplog.at_level(logging.WARNING):
        env.build_dataset(None)
    assert env.same_task_in_group is False and "different tasks" in caplog.text
    assert "one group, one task: NO" in env.env_style()
    # replaying such an episode cannot reproduce it: a clear error, not a wrong score
    other = Unseeded()
    other.reset()
    transcript = [{"role": "assistant", "content": _call(5)}, {"role": "tool", "name": "guess", "content": "zzz"}]
    with pytest.raises(ValueError, match="not deterministic given its row"):
        env.replay(transcript, {"episode": 0})


class NoReward:
    def reset(self, **kwargs):
        return None

    def act(self, x: int) -> int:
        """Act.

        Args:
            x: A number.
        """
        return x


class NoDocstring(NoReward):
    def get_reward(self):
        return 0.0

    def act(self, x):
        return x


@pytest.mark.parametrize("kwargs, says", [
    ({"factory": NoReward, "num_episodes": 2}, "no get_reward() method"),
    ({"factory": NoDocstring, "num_episodes": 2}, "NoDocstring.act is a tool (a public method) but its schema"),
    ({"factory": "no_such_module.Env", "num_episodes": 2}, "env.factory='no_such_module.Env': importing module"),
    ({"factory": "grpo_pipeline.envs.guess.Nope", "num_episodes": 2}, "has no class or function 'Nope'"),
    ({"factory": GuessNumber, "dataset": "missing.jsonl"}, "env.dataset='missing.jsonl': no such file"),
    ({"factory": GuessNumber, "factory_kwargs": {"size": 3}, "num_episodes": 2}, "Fix env.factory_kwargs"),
])
def test_mistakes_are_config_errors_that_name_the_key(kwargs, says):
    with pytest.raises(ConfigError) as e:
        TRLEnv(**kwargs).build_dataset(None)
    assert says in str(e.value)


def test_neither_dataset_nor_episodes_is_refused():
    with pytest.raises(ValueError, match="set env.dataset .* or env.num_episodes"):
        TRLEnv(GuessNumber)


def test_the_opening_prompts_from_a_named_dataset(tmp_path, monkeypatch):
    rows = [{"prompt": [{"role": "user", "content": f"Game {i}."}], "episode": i} for i in range(3)]
    (tmp_path / "games.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "my_games.py").write_text(f"ROWS = {rows!r}\ndef make():\n    return [{{'prompt': r['prompt']}} "
                                         "for r in ROWS[:2]]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    from_file = TRLEnv(GuessNumber, dataset="games.jsonl", num_episodes=100).build_dataset(None)
    assert len(from_file) == 3 and from_file[1]["prompt"][0]["content"] == "Game 1."  # the dataset replaces the 100
    env = TRLEnv(GuessNumber, dataset="my_games.ROWS")
    assert len(env.build_dataset(None)) == 3 and not env.prompt_is_task and env.heldout_group_by == ["episode"]
    env = TRLEnv(GuessNumber, dataset="my_games.make")  # no episode column: the prompt names the task
    assert len(env.build_dataset(None)) == 2 and env.prompt_is_task and env.heldout_group_by == []


def test_env_trl_trains_records_every_turn_and_rescores_by_replay(compose_cfg, tmp_path, monkeypatch, tiny, capsys):
    """A real training run (tiny model) on env=trl whose policy calls the tool: the ledger has every turn and
    the reset() text, rescoring replays the episodes to the same rewards, the env's metrics are logged."""
    tokenizer = build_tiny_tokenizer()
    cfg = compose_cfg([*tiny_overrides(tmp_path, ["env=trl", "env.num_episodes=24", "env.turn_max_new_tokens=64"]),
                       "eval.enabled=true",
                       "eval.num_prompts=4"])
    seen_rows = []
    original = Rollout.run

    def run(self, model, prompts, rows, sampling, **kw):  # each call scripts its episodes by their rows
        seen_rows.append([r["episode"] for r in rows])
        episodes = [r["episode"] for r in rows]
        monkeypatch.setattr(turns_module, "generate", scripted(tokenizer, _plan(episodes), real_logps=True))
        return original(self, model, prompts, rows, sampling, **kw)

    monkeypatch.setattr(Rollout, "run", run)
    result = recipe.train(cfg, launch_dir=str(tmp_path))
    assert result.steps == 2
    from grpo_pipeline.tracking.ledger import read

    entries = read(tmp_path / "run" / "episodes.jsonl")
    train = [e for e in entries if e["split"] == "train"]
    assert len(train) == 8 and all(set(e["row"]) == {"episode"} for e in train)  # no rollout fields in the row
    for e in train + [e for e in entries if e["split"] == "test_after"]:
        assert "I am thinking of a whole number" in e["prompt"]  # the opening as the episode began
        assert [m["role"] for m in e["messages"]][:4] == ["assistant", "tool", "assistant", "tool"]
        assert e["reward"] == pytest.approx(1.0 if _secret(e["row"]["episode"]) == 10 else 0.9)
    from grpo_pipeline.tools.rescore import main as rescore_main

    monkeypatch.setattr("sys.argv", ["rescore", str(tmp_path / "run")])
    rescore_main()
    out = capsys.readouterr().out
    assert "train            1        4" in out and "failed" in out
    lines = [line.split() for line in out.splitlines() if line.startswith(("train", "test_"))]
    assert lines and all(cols[-2:] == ["0", "0"] for cols in lines)  # none changed, none failed
    from mlflow.tracking import MlflowClient

    metrics = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(result.mlflow_run_id).data.metrics
    assert metrics["env/tool_calls"] == 2 and metrics["env/turns_mean"] == 3


def test_the_doctor_describes_a_trl_env(compose_cfg, tmp_path):
    from grpo_pipeline.tools.doctor import run_check

    cfg = compose_cfg(["model=tiny", "env=trl", "env.num_episodes=6", "check.num_prompts=2",
                       "generation.max_new_tokens=6", "env.turn_max_new_tokens=6", "generation.num_generations=3",
                       "training.batch_size=6", "check.num_generations=[2,3]", f"output_dir={tmp_path}"])
    text = run_check(cfg).text()
    assert "env style: TRL environment GuessNumber (environment_factory): tools guess" in text
    assert "one group, one task: yes" in text
    assert "the first episode's opening, as its session extended it:" in text and "I am thinking of" in text
