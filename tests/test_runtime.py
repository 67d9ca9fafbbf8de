"""The env runtime: concurrency, timeouts, revocable model handles, the failure budget, failed episodes
in GRPO groups, held-out evaluation, score checks and sampling of the env's turns."""

import math
import threading
import time

import pytest
import torch
from hydra.errors import ConfigCompositionException

from grpo_pipeline.config.schema import RuntimeConfig
from grpo_pipeline.config.validate import config_problems
from grpo_pipeline.envs.runner import EpisodeAbandoned, EpisodeRunner, completion_text
from grpo_pipeline.errors import EnvError

WAIT = 60  # seconds: generous bounds for conditions that hold within milliseconds on an idle machine
SAMPLING = {"do_sample": True, "temperature": 0.7, "top_k": 0, "top_p": 1.0}


class FakeModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.seen = []  # (training, grad enabled) per generate
        self.kwargs = []  # the sampling kwargs of each generate
        self.forwards = 0
        self.hold: threading.Event | None = None  # when set: generate waits for it
        self.entered = threading.Event()
        self.running = 0  # generate calls running now
        self.lock = threading.Lock()

    def generate(self, input_ids, attention_mask=None, max_new_tokens=1, **kwargs):
        with self.lock:
            self.running += 1
        try:
            self.seen.append((self.training, torch.is_grad_enabled()))
            self.kwargs.append(kwargs)
            self.entered.set()
            if self.hold is not None:
                assert self.hold.wait(WAIT)
            out = self.lin(torch.ones(input_ids.shape[0], 2)).argmax(dim=1, keepdim=True)
            return torch.cat([input_ids, out.repeat(1, max_new_tokens)], dim=1)
        finally:
            with self.lock:
                self.running -= 1

    def forward(self, x):
        self.forwards += 1
        return self.lin(x)


BAD_VALUES = {"None": None, "nan": math.nan, "1.5": 1.5, "-0.1": -0.1, "str": "high", "True": True}


class ScriptedEnv:
    """score_episode does whatever the completion says."""

    def __init__(self):
        self.go = threading.Event()  # lets a "late" or "block" episode go on
        self.finished = threading.Event()
        self.errors: list[BaseException] = []
        self.stashed = None
        self.gen_kwargs: dict[str, dict] = {}
        self.lock = threading.Lock()
        self.inside = self.max_inside = 0

    def score_episode(self, model, tokenizer, completion, answer=None):
        with self.lock:
            self.inside += 1
            self.max_inside = max(self.max_inside, self.inside)
        try:
            return self._play(model, completion)
        finally:
            with self.lock:
                self.inside -= 1

    def _play(self, model, completion):
        kind, _, arg = completion.partition(":")
        if kind == "sleep":
            time.sleep(float(arg))
            return 1.0
        if kind == "raise":
            raise ValueError("env exploded")
        if kind == "value":
            return BAD_VALUES[arg]
        if kind == "score":
            return float(arg)
        if kind == "generate":
            kwargs = self.gen_kwargs.get(arg, {})
            out = model.generate(torch.ones(1, 2, dtype=torch.long), max_new_tokens=3, **kwargs)
            return 1.0 if out.shape == (1, 5) and not out.requires_grad else 0.0
        if kind == "late":  # outlives its timeout, then tries every way into the model
            self.go.wait(WAIT)
            x, ids = torch.ones(1, 2), torch.ones(1, 2, dtype=torch.long)
            for use in (lambda: model.generate(ids), lambda: model(x), lambda: model.forward(x), lambda: model.lin):
                try:
                    use()
                except BaseException as e:
                    self.errors.append(e)
            self.finished.set()
            return 1.0
        if kind == "block":
            self.go.wait(WAIT)
            self.finished.set()
            return 1.0
        if kind == "stash":
            self.stashed = model
            return 1.0
        return 0.5


def runner(env=None, sampling=None, **cfg) -> EpisodeRunner:
    r = EpisodeRunner(env or ScriptedEnv(), None, RuntimeConfig(**cfg), ["answer"], sampling)
    r.bind(FakeModel())
    return r


def rows(n):
    return [{"answer": i} for i in range(n)]


# --- concurrency and timeouts ---------------------------------------------------------------------


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
    r = runner(env, max_concurrency=8)
    start = time.monotonic()
    r.score(["sleep:0.05"] * 6, rows(6))
    assert time.monotonic() - start >= 0.3
    assert env.max_inside == 1


def test_timeout_scores_zero_and_does_not_hang():
    r = runner(episode_timeout_s=0.3, on_error="zero")
    start = time.monotonic()
    scores, metrics = r.score(["sleep:30", "ok", "ok"], rows(3))
    assert time.monotonic() - start < 2
    assert scores == [0.0, 0.5, 0.5]
    assert metrics["env/timeouts"] == 1 and metrics["env/failures"] == 1


def test_timeout_with_raise_policy_names_the_setting():
    r = runner(episode_timeout_s=0.2, on_error="raise")
    with pytest.raises(EnvError, match=r"timed out after 0.2s \(runtime.episode_timeout_s\)"):
        r.score(["sleep:30"], rows(1))


def test_not_thread_safe_env_never_overlaps_an_abandoned_episode():
    env = ScriptedEnv()
    env.thread_safe = False
    r = runner(env, episode_timeout_s=1.0, on_error="zero")
    scores, _ = r.score(["score:1", "block:"], rows(2))  # "block" is abandoned, still holding the env
    assert scores == [1.0, 0.0]
    scores, metrics = r.score(["score:1", "score:1"], rows(2))  # the next batch waits for it, and times out
    assert scores == [0.0, 0.0] and metrics["env/timeouts"] == 3
    r.cfg.on_error = "raise"
    with pytest.raises(EnvError, match="waiting for an abandoned episode of this non-thread-safe env"):
        r.score(["score:1"], rows(1))
    env.go.set()
    assert env.finished.wait(WAIT)
    r.cfg.episode_timeout_s = WAIT  # "block" ends right after finished is set; this one waits for it
    assert r.score(["score:1"], rows(1))[0] == [1.0]  # the env is free again
    assert env.max_inside == 1


# --- the model handle -----------------------------------------------------------------------------


def test_abandoned_episode_can_no_longer_use_the_model():
    env = ScriptedEnv()
    r = runner(env, episode_timeout_s=0.3)
    scores, _ = r.score(["late:", "ok"], rows(2))
    assert scores == [0.0, 0.5]
    env.go.set()  # training would go on now; the abandoned episode wakes up and reaches for the model
    assert env.finished.wait(WAIT)
    assert len(env.errors) == 4 and all(isinstance(e, EpisodeAbandoned) for e in env.errors), env.errors
    assert str(env.errors[0]) == ("episode 0 of ScriptedEnv was abandoned after its timeout "
                                  "(runtime.episode_timeout_s=0.3); it can no longer use the model.")
    assert r.model.seen == [] and r.model.forwards == 0


def test_a_model_kept_beyond_its_episode_is_refused():
    env = ScriptedEnv()
    r = runner(env)
    assert r.score(["stash:"], rows(1))[0] == [1.0]
    with pytest.raises(EpisodeAbandoned, match="episode 0 of ScriptedEnv ended with its batch"):
        env.stashed.generate(torch.ones(1, 2, dtype=torch.long))
    assert r.model.seen == []


@pytest.mark.parametrize("batch_generate", [True, False])
def test_score_returns_only_after_model_calls_in_flight_finish(batch_generate):
    r = runner(episode_timeout_s=0.3, max_concurrency=2, batch_generate=batch_generate, batch_wait_ms=5)
    r.model.hold = threading.Event()
    result = {}

    def score():
        result["scores"], _ = r.score(["generate:", "generate:"], rows(2))
        result["running_at_return"] = r.model.running

    t = threading.Thread(target=score)
    t.start()
    assert r.model.entered.wait(WAIT)
    # both episodes time out after 0.3 s, but a generate is still running (merged: longer than a 5 s join)
    t.join(timeout=6.0 if batch_generate else 1.0)
    assert t.is_alive(), "score() returned while the env's generate was still running"
    r.model.hold.set()
    t.join(timeout=WAIT)
    assert not t.is_alive()
    assert result == {"scores": [0.0, 0.0], "running_at_return": 0}


def test_env_generate_runs_in_eval_mode_without_grad_and_train_mode_is_restored():
    r = runner()
    r.model.train()
    scores, _ = r.score(["generate:"] * 3, rows(3))
    assert scores == [1.0] * 3
    assert r.model.seen and set(r.model.seen) == {(False, False)}  # batched: one or more calls
    assert r.model.training is True


def test_env_turns_sample_with_the_configured_settings_and_greedily_in_evaluation():
    env = ScriptedEnv()
    env.gen_kwargs = {"own_temperature": {"temperature": 0.2}, "greedy": {"do_sample": False}}
    r = runner(env, sampling=SAMPLING, batch_generate=False)
    r.score(["generate:", "generate:own_temperature", "generate:greedy"], rows(3))
    # the call sampling as the run does is recorded (its turn is trained): generate is asked for its logits
    recorded = {"output_logits": True, "return_dict_in_generate": True}
    expected = [SAMPLING | recorded, SAMPLING | {"temperature": 0.2}, {"do_sample": False}]
    assert _canonical(r.model.kwargs) == _canonical(expected)
    # this fake generate returns a plain tensor, no logits: the call works, is not trained, and is counted
    assert [len(s) for s in r.last_batch["turn_samples"]] == [0, 0, 0] and r.last_batch["turn_samples_skipped"] == 3
    r.model.kwargs.clear()
    r.score(["generate:", "generate:own_temperature"], rows(2), evaluation=True)
    expected = [{"do_sample": False}, {"do_sample": False, "temperature": 0.2}]
    assert _canonical(r.model.kwargs) == _canonical(expected)


def _canonical(dicts: list[dict]) -> list[list]:
    return sorted(sorted(d.items()) for d in dicts)


# --- failure policy -------------------------------------------------------------------------------


def test_exception_with_raise_policy_has_traceback_row_and_completion():
    r = runner(on_error="raise")
    with pytest.raises(EnvError) as e:
        r.score(["ok", "raise:now"], rows(2))
    msg = str(e.value)
    assert "ScriptedEnv.score_episode raised" in msg and "ValueError: env exploded" in msg
    assert "{'answer': 1}" in msg and "'raise:now'" in msg and 'line' in msg  # traceback lines


def test_a_flaky_env_survives_a_long_run():
    r = runner(on_error="zero")  # defaults: max_failure_rate=0.1 over failure_window=200
    for _ in range(30):  # 3000 episodes, 1 % of them fail
        completions = ["ok"] * 99 + ["raise:x"]
        scores, metrics = r.score(completions, rows(100))
        assert scores == [0.5] * 99 + [0.0]
    assert metrics["env/failures"] == 30 and metrics["env/failures_in_batch"] == 1


def test_a_burst_of_failures_stops_the_run_naming_both_keys():
    r = runner(on_error="zero")
    for _ in range(10):
        r.score(["ok"] * 40, rows(40))
    r.score(["ok"] * 30 + ["raise:x"] * 10, rows(40))
    r.score(["ok"] * 30 + ["raise:x"] * 10, rows(40))  # 20 of the last 200: at the limit, not over it
    with pytest.raises(EnvError) as e:
        r.score(["ok"] * 39 + ["raise:x"], rows(40))
    msg = str(e.value)
    assert "21 of the last 200 episodes of ScriptedEnv failed or timed out" in msg
    assert "runtime.max_failure_rate=0.1 x runtime.failure_window=200 = 20" in msg
    assert "ValueError: env exploded" in msg and "{'answer': 30}" in msg and "'raise:x'" in msg


def test_an_env_that_fails_every_episode_of_two_batches_looks_broken():
    r = runner(on_error="zero", max_failure_rate=1.0)
    assert r.score(["raise:x"] * 3, rows(3))[0] == [0.0] * 3
    with pytest.raises(EnvError, match=r"Every episode of the first 2 batches of ScriptedEnv failed .* broken"):
        r.score(["raise:x"] * 3, rows(3))
    r = runner(on_error="zero", max_failure_rate=1.0)
    r.score(["raise:x"] * 3, rows(3))
    r.score(["raise:x", "ok"], rows(2))  # one success: not broken
    r.score(["raise:x"] * 3, rows(3))


def test_runtime_keys_are_validated_by_name(compose_cfg, tmp_path):
    cfg = compose_cfg(["runtime.max_failure_rate=1.5", "runtime.failure_window=0", f"output_dir={tmp_path}"])
    problems = config_problems(cfg)
    assert any(p.startswith("runtime.max_failure_rate=1.5: must be in [0, 1]") for p in problems), problems
    assert any(p.startswith("runtime.failure_window=0: must be >= 1") for p in problems), problems
    with pytest.raises(ConfigCompositionException):
        compose_cfg(["runtime.max_failures=5"])  # replaced by max_failure_rate / failure_window


@pytest.mark.parametrize("value", sorted(BAD_VALUES))
def test_bad_scores_always_stop(value):
    r = runner(on_error="zero")
    with pytest.raises(EnvError) as e:
        r.score([f"value:{value}"], rows(1))
    assert "ScriptedEnv.score_episode returned" in str(e.value) and "{'answer': 0}" in str(e.value)
    assert f"returned {BAD_VALUES[value]!r}" in str(e.value)


# --- what TRL and the evaluation see --------------------------------------------------------------


def test_reward_function_passes_extra_columns_and_logs_metrics():
    r = runner()
    logged = {}
    fn = r.reward_function()
    scores = fn(
        prompts=["p", "p"], completions=[[{"role": "assistant", "content": "ok"}], "ok"], answer=[1, 2],
        trainer_state=None, log_metric=lambda k, v: logged.__setitem__(k, v),
    )
    assert scores == [0.5, 0.5] and fn.__name__ == "env"
    assert {"env/failures", "env/failures_in_batch", "env/timeouts", "env/episode_seconds_mean"} <= set(logged)


def test_failed_episodes_are_unscorable_so_trl_gives_them_no_advantage():
    """A failed episode's reward is None: TRL 1.16 leaves it out of its group's mean and std and zeroes its
    advantage (checked here with TRL's own nan-aware arithmetic)."""
    from trl.trainer.utils import nanstd

    r = runner()
    logged = {}
    completions = ["score:1", "raise:x", "score:0.2", "score:0.6",  # group of prompt a
                   "raise:x", "raise:x", "raise:x", "raise:x"]  # b: all failed
    prompts = ["a"] * 4 + ["b"] * 4
    env = r.reward_function()
    scores = env(prompts=prompts, completions=completions, answer=list(range(8)),
                 log_metric=lambda k, v: logged.__setitem__(k, v))
    assert scores == [1.0, None, 0.2, 0.6, None, None, None, None]
    assert logged["env/failures_in_batch"] == 5 and logged["env/failures"] == 5

    rewards = torch.tensor([float("nan") if s is None else s for s in scores]).view(2, 4)
    advantages = (rewards - rewards.nanmean(dim=1, keepdim=True)) / (nanstd(rewards, dim=1).unsqueeze(1) + 1e-4)
    advantages = torch.nan_to_num(advantages, nan=0.0).flatten()
    assert advantages[1] == 0 and (advantages[4:] == 0).all()
    assert advantages[0] > 0 > advantages[2]  # the baseline is the mean of 1, 0.2, 0.6 only
    assert rewards[0].nanmean().item() == pytest.approx(0.6)


def test_a_failed_episode_is_unscorable_for_every_reward_component():
    from grpo_pipeline.rewards.assemble import _named

    r = runner()
    env = r.reward_function()
    component = _named(lambda prompts, completions, **_: [0.3] * len(completions), "fmt", env)
    completions = ["score:1", "raise:x"]
    env(prompts=["a", "a"], completions=completions, answer=[0, 1])
    assert component(prompts=["a", "a"], completions=completions) == [0.3, None]
    assert component(prompts=["a", "a"], completions=list(completions)) == [0.3, 0.3]  # another batch: as scored


def test_evaluation_counts_failures_apart_and_never_stops_the_run():
    r = runner(on_error="raise", max_failure_rate=0.0)
    for _ in range(3):  # would stop a training run at once (raise, rate 0, a broken env)
        scores, metrics = r.score(["raise:x", "score:1", "raise:x"], rows(3), evaluation=True)
        assert scores == [0.0, 1.0, 0.0] and metrics["eval/failures"] == 2
    assert r.eval_failures == 6 and r.failures == 0 and r.budget.episodes == 0
    with pytest.raises(EnvError, match="returned nan"):
        r.score(["value:nan"], rows(1), evaluation=True)
    with pytest.raises(EnvError, match="env exploded"):
        r.score(["raise:x"], rows(1))


def test_completion_text():
    assert completion_text("abc") == "abc"
    assert completion_text([{"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"}]) == "a"


class LongCallEnv:
    """Asks the model for many tokens: explicitly, or by leaving max_new_tokens to the model's max_length."""

    def score_episode(self, model, tokenizer, completion, answer=None):
        ids = torch.ones(1, 2, dtype=torch.long)
        out = model.generate(ids, max_new_tokens=5000) if completion == "explicit" else model.generate(ids)
        return min(1.0, (out.shape[1] - 2) / 10_000)


def test_an_env_model_call_is_capped_at_max_call_tokens(caplog):
    class Recording(FakeModel):
        generation_config = type("Config", (), {"max_length": 100_000})()

        def generate(self, input_ids, attention_mask=None, max_new_tokens=None, **kwargs):
            self.asked = getattr(self, "asked", []) + [(max_new_tokens, kwargs.get("max_length"))]
            return torch.cat([input_ids, torch.zeros(1, max_new_tokens or 1, dtype=torch.long)], dim=1)

    r = EpisodeRunner(LongCallEnv(), None, RuntimeConfig(max_call_tokens=64, batch_generate=False), ["answer"])
    r.bind(Recording())
    scores, _ = r.score(["explicit", "implicit"], rows(2))
    assert sorted(r.model.asked) == [(64, None), (64, None)]  # 5000 asked; 99,998 left by max_length
    assert scores == [pytest.approx(64 / 10_000)] * 2


def test_a_model_call_outliving_its_batch_past_the_deadline_stops_the_run_naming_it():
    r = runner(episode_timeout_s=0.2, call_deadline_s=1.0, batch_generate=False)
    r.model.hold = threading.Event()  # the env's generate never returns on its own
    started = time.monotonic()
    try:
        with pytest.raises(EnvError, match=r"1 model call\(s\) of env episodes \(episode 0 \(row \{'answer': 0\}\)\) "
                                           r"still ran 1s \(runtime.call_deadline_s\)"):
            r.score(["generate:"], rows(1))
        assert time.monotonic() - started < 10  # the timeout (0.2 s) plus the deadline (1 s), not forever
    finally:
        r.model.hold.set()


class TokenizingEnv:
    """Each episode tokenizes with its own padding/truncation settings, many times: a fast tokenizer keeps those
    settings in itself, so unguarded concurrent calls run with another thread's settings."""

    text = "hello world and more words " * 20

    def score_episode(self, model, tokenizer, completion, answer=0):
        for _ in range(150):
            if answer % 2:
                ids = tokenizer([self.text, "hi"], padding="max_length", max_length=300, truncation=True)["input_ids"]
                if len(ids[1]) != 300:
                    return 0.0
            elif len(tokenizer(self.text)["input_ids"]) < 100:
                return 0.0
        return 1.0


def test_env_threads_sharing_the_fast_tokenizer_get_their_own_settings():
    from transformers import PreTrainedTokenizerBase

    from grpo_pipeline.models import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    r = EpisodeRunner(TokenizingEnv(), tokenizer, RuntimeConfig(max_concurrency=8, episode_timeout_s=WAIT),
                      ["answer"])
    r.bind(FakeModel())
    assert isinstance(r.tokenizer, PreTrainedTokenizerBase) and r.tokenizer.pad_token_id == tokenizer.pad_token_id
    scores, _ = r.score(["x"] * 16, rows(16))
    assert scores == [1.0] * 16  # 2,400 concurrent calls, each with its own settings


def test_the_shared_tokenizer_runs_one_call_at_a_time():
    from grpo_pipeline.envs.shared_tokenizer import SharedTokenizer

    class Slow:
        inside = most = 0
        lock = threading.Lock()

        def __call__(self, text):
            with self.lock:
                self.inside += 1
                self.most = max(self.most, self.inside)
            time.sleep(0.005)
            with self.lock:
                self.inside -= 1
            return text

        def decode(self, ids):
            return self(str(ids))

    slow = Slow()
    tokenizer = SharedTokenizer(slow)
    threads = [threading.Thread(target=lambda: [tokenizer("a"), tokenizer.decode([1])]) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=WAIT)
    assert slow.most == 1 and isinstance(tokenizer, Slow)


def test_batched_env_calls_run_on_the_thread_that_scores():
    """The episodes' merged generate calls run on the thread that waits for them (the trainer's): torch's kernels
    ran ~1.3x slower on a thread of the batcher's own (docs/results.md)."""
    r = runner(max_concurrency=8, batch_wait_ms=WAIT * 1000)  # merged once every episode waits, however loaded
    ran_on, generate = [], r.model.generate
    r.model.generate = lambda *a, **kw: ran_on.append(threading.current_thread()) or generate(*a, **kw)
    scores, _ = r.score(["generate:"] * 4 + ["score:0.5"], rows(5))
    assert scores == [1.0] * 4 + [0.5]
    assert ran_on and set(ran_on) == {threading.current_thread()}
    assert len(r.model.kwargs) == 1  # the 4 calls merged into one

