"""The env runtime: concurrency, timeouts, failure policy, score checks, and a safe model handle."""

import math
import time

import pytest
import torch

from grpo_pipeline.config.schema import RuntimeConfig
from grpo_pipeline.errors import EnvError
from grpo_pipeline.runtime.episodes import EpisodeRunner, completion_text


class FakeModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.seen = []

    def generate(self, input_ids, attention_mask=None, max_new_tokens=1):
        self.seen.append((self.training, torch.is_grad_enabled()))
        out = self.lin(torch.ones(input_ids.shape[0], 2)).argmax(dim=1, keepdim=True)
        return torch.cat([input_ids, out.repeat(1, max_new_tokens)], dim=1)


BAD_VALUES = {"None": None, "nan": math.nan, "1.5": 1.5, "-0.1": -0.1, "str": "high", "True": True}


class ScriptedEnv:
    """score_episode does whatever the completion says."""

    def score_episode(self, model, tokenizer, completion, answer=None):
        kind, _, arg = completion.partition(":")
        if kind == "sleep":
            time.sleep(float(arg))
            return 1.0
        if kind == "raise":
            raise ValueError("env exploded")
        if kind == "value":
            return BAD_VALUES[arg]
        if kind == "generate":
            out = model.generate(torch.ones(1, 2, dtype=torch.long), max_new_tokens=3)
            return 1.0 if out.shape == (1, 5) and not out.requires_grad else 0.0
        return 0.5


def runner(**cfg) -> EpisodeRunner:
    r = EpisodeRunner(ScriptedEnv(), None, RuntimeConfig(**cfg), ["answer"])
    r.bind(FakeModel())
    return r


def rows(n):
    return [{"answer": i} for i in range(n)]


def test_io_bound_episodes_run_concurrently():
    r = runner(max_concurrency=16)
    start = time.monotonic()
    scores, _ = r.score(["sleep:0.2"] * 16, rows(16))
    elapsed = time.monotonic() - start
    assert scores == [1.0] * 16
    assert elapsed < 16 * 0.2 / 4, elapsed  # sequential would take 3.2 s


def test_not_thread_safe_env_runs_one_at_a_time():
    env = ScriptedEnv()
    env.thread_safe = False
    r = EpisodeRunner(env, None, RuntimeConfig(max_concurrency=8), ["answer"])
    r.bind(FakeModel())
    start = time.monotonic()
    r.score(["sleep:0.05"] * 6, rows(6))
    assert time.monotonic() - start >= 0.3


def test_timeout_scores_zero_and_does_not_hang():
    r = runner(episode_timeout_s=0.3, on_error="zero", max_failures=5)
    start = time.monotonic()
    scores, metrics = r.score(["sleep:30", "ok", "ok"], rows(3))
    assert time.monotonic() - start < 2
    assert scores == [0.0, 0.5, 0.5]
    assert metrics["env/timeouts"] == 1 and metrics["env/failures"] == 1


def test_timeout_with_raise_policy_names_the_setting():
    r = runner(episode_timeout_s=0.2, on_error="raise")
    with pytest.raises(EnvError, match=r"timed out after 0.2s \(runtime.episode_timeout_s\)"):
        r.score(["sleep:30"], rows(1))


def test_exception_with_raise_policy_has_traceback_row_and_completion():
    r = runner(on_error="raise")
    with pytest.raises(EnvError) as e:
        r.score(["ok", "raise:now"], rows(2))
    msg = str(e.value)
    assert "ScriptedEnv.score_episode raised" in msg and "ValueError: env exploded" in msg
    assert "{'answer': 1}" in msg and "'raise:now'" in msg and 'line' in msg  # traceback lines


def test_zero_policy_counts_then_stops_after_max_failures():
    r = runner(on_error="zero", max_failures=2)
    scores, metrics = r.score(["raise:x", "raise:x", "ok"], rows(3))
    assert scores == [0.0, 0.0, 0.5] and metrics["env/failures"] == 2
    with pytest.raises(EnvError, match=r"3 episodes of ScriptedEnv failed or timed out, more than runtime.max_failures=2"):
        r.score(["raise:x"], rows(1))


@pytest.mark.parametrize("value", sorted(BAD_VALUES))
def test_bad_scores_always_stop(value):
    r = runner(on_error="zero")
    with pytest.raises(EnvError) as e:
        r.score([f"value:{value}"], rows(1))
    assert "ScriptedEnv.score_episode returned" in str(e.value) and "{'answer': 0}" in str(e.value)
    assert f"returned {BAD_VALUES[value]!r}" in str(e.value)


def test_env_generate_runs_in_eval_mode_without_grad_and_train_mode_is_restored():
    r = runner()
    r.model.train()
    scores, _ = r.score(["generate:"] * 3, rows(3))
    assert scores == [1.0] * 3
    assert r.model.seen and set(r.model.seen) == {(False, False)}  # batched: one or more calls
    assert r.model.training is True


def test_reward_function_passes_extra_columns_and_logs_metrics():
    r = runner()
    logged = {}
    fn = r.reward_function()
    scores = fn(
        prompts=["p", "p"], completions=[[{"role": "assistant", "content": "ok"}], "ok"], answer=[1, 2],
        trainer_state=None, log_metric=lambda k, v: logged.__setitem__(k, v),
    )
    assert scores == [0.5, 0.5] and fn.__name__ == "env"
    assert {"env/failures", "env/timeouts", "env/episode_seconds_mean"} <= set(logged)


def test_completion_text():
    assert completion_text("abc") == "abc"
    assert completion_text([{"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"}]) == "a"
