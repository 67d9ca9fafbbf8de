"""The env doctor: a report with score statistics and warnings; non-zero exit when the env is broken."""



import re

import pytest

from grpo_pipeline.tools.doctor import Report, _learnability, best_of_k, flat_share, pass_at_k, run_check

SHRINK = ["model=tiny", "check.num_prompts=2", "generation.max_new_tokens=6", "generation.num_generations=3",
          "training.batch_size=6", "check.num_generations=[2,3]"]

BROKEN_ENV = """
from datasets import Dataset
class Broken:
    def build_dataset(self, tokenizer):
        return Dataset.from_list([{"prompt": f"q{i}", "i": i} for i in range(4)])
    def score_episode(self, model, tokenizer, completion, i):
        if i % 2:
            raise KeyError("missing answer")
        return 2.0
"""


def test_report_on_a_working_env(compose_cfg, tmp_path):
    cfg = compose_cfg([*SHRINK, "env.num_samples=10", f"output_dir={tmp_path}"])
    report = run_check(cfg)
    text = report.text()
    assert "dataset: 10 rows, columns ['prompt', 'answer']" in text
    assert "generated 6 completions (2 prompts x 3)" in text
    assert "scores: n=6" in text and "failures: 0, timeouts: 0" in text
    assert "learnability over 2 prompts x 3 samples" in text
    assert "num_generations=2: flat groups 100%" in text and "num_generations=3: flat groups 100%" in text
    # the tiny random model never earns credit: the doctor says so, and what to do
    assert any("all scores are 0" in w for w in report.warnings)
    assert any(w.startswith("the env gives no signal") for w in report.warnings)
    # ...and a bare answer tag earns the format credit the model never gets: a (real) exploit of this reward
    assert any("possible reward exploit: 'tag, random value'" in w for w in report.warnings)
    assert not any("'empty'" in w or "nondeterministic" in w for w in report.warnings)
    assert not report.broken and "verdict: OK with warnings" in text


def test_broken_env_exits_nonzero_with_reasons(tmp_path):
    (tmp_path / "broken_env.py").write_text(BROKEN_ENV)
    proc = run_cli_check([*SHRINK, "env=custom", "env._target_=broken_env.Broken"], tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "BROKEN: score_episode raised KeyError" in proc.stdout
    assert "BROKEN: score_episode returned 2.0" in proc.stdout and "verdict: BROKEN" in proc.stdout


def test_unloadable_env_exits_2(tmp_path):
    proc = run_cli_check([*SHRINK, "env=custom", "env._target_=nowhere.Env"], tmp_path)
    assert proc.returncode == 2 and "module 'nowhere' cannot be imported" in proc.stderr


def run_cli_check(args, cwd):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "grpo_pipeline.tools.doctor", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)




PLANTED = """
import random
from datasets import Dataset

class _Base:
    def build_dataset(self, tokenizer):
        return Dataset.from_list([{"prompt": f"Say the word number {i}.", "secret": f"zebra{i}x"} for i in range(6)])

class EmptyWins(_Base):   # planted exploit: the empty completion earns full marks
    def score_episode(self, model, tokenizer, completion, secret):
        return 1.0 if not completion.strip() else 0.1

class Noisy(_Base):       # planted nondeterminism: the score ignores the completion
    def score_episode(self, model, tokenizer, completion, secret):
        return random.random()

class Honest(_Base):      # only the hidden right answer scores; no degenerate text can
    def score_episode(self, model, tokenizer, completion, secret):
        return 1.0 if secret in completion else 0.0

class _WithExample(_Base):  # a worked example in the prompt: the example's answer is zebra0x
    def build_dataset(self, tokenizer):
        example = [{"role": "user", "content": "Say the word number 0."}, {"role": "assistant", "content": "zebra0x"}]
        return Dataset.from_list([{"prompt": example + [{"role": "user", "content": f"Say the word number {i}."}],
                                   "secret": f"zebra{i}x"} for i in range(1, 7)])

class PaysTheExample(_WithExample):  # planted exploit: the example's answer earns partial credit anywhere
    def score_episode(self, model, tokenizer, completion, secret):
        return 1.0 if secret in completion else 0.5 if "zebra0x" in completion else 0.0

class HonestWithExample(_WithExample):
    def score_episode(self, model, tokenizer, completion, secret):
        return 1.0 if secret in completion else 0.0

class _Turns(_WithExample):  # multi-turn (the runtime plays the turns); one turn, then done
    max_turns, turn_max_new_tokens = 2, 6
    def respond(self, messages, secret):
        return None
    def score_episode(self, model, tokenizer, completion, secret):
        return 1.0 if secret in "".join(m["content"] for m in completion if m["role"] == "assistant") else 0.0

class PaysTheExampleTurn(_Turns):  # planted turn-credit hole: a turn repeating any earlier reply of the conversation
    def score_turn(self, messages, secret):  # pays, the worked example's included (env=hotel's bug, 2026-12-07)
        earlier = [m["content"] for m in messages[:-1] if m["role"] == "assistant"]
        return 0.5 if messages[-1]["content"].strip() in earlier else 0.0

class HonestTurns(_Turns):  # the same, over this episode's turns only (after the last user message)
    def score_turn(self, messages, secret):
        start = max(i for i, m in enumerate(messages) if m["role"] == "user") + 1
        earlier = [m["content"] for m in messages[start:-1] if m["role"] == "assistant"]
        return 0.5 if messages[-1]["content"].strip() in earlier else 0.0

class Graded(_Base):      # spread within groups: the completion's length decides
    def score_episode(self, model, tokenizer, completion, secret):
        return min(1.0, len(completion) / 40)
"""


@pytest.fixture
def planted(tmp_path, monkeypatch):
    (tmp_path / "planted_envs.py").write_text(PLANTED)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _doctor(compose_cfg, tmp_path, cls, *extra):
    cfg = compose_cfg([*SHRINK, "env=custom", f"env._target_=planted_envs.{cls}", f"output_dir={tmp_path}", *extra])
    return run_check(cfg)


def test_doctor_flags_a_planted_exploit(compose_cfg, planted):
    report = _doctor(compose_cfg, planted, "EmptyWins")
    exploits = [w for w in report.warnings if w.startswith("possible reward exploit")]
    assert any("'empty'" in w and "earn 1.000" in w for w in exploits)
    assert any("'whitespace'" in w for w in exploits)
    assert not any("'half a good answer'" in w for w in exploits)  # tiny completions: half of one is not empty
    assert re.search(r"empty\s+1\.000\s+\(env=1\.00", report.text())


def test_doctor_flags_a_nondeterministic_reward(compose_cfg, planted):
    report = _doctor(compose_cfg, planted, "Noisy")
    assert any(w.startswith("nondeterministic reward: the same completion scored") for w in report.warnings)


def test_doctor_stays_quiet_on_an_honest_reward(compose_cfg, planted):
    report = _doctor(compose_cfg, planted, "Honest")
    assert not any("exploit" in w or "nondeterministic" in w for w in report.warnings), report.warnings
    assert "scored 6 completions a second time: 0 got a different score" in report.text()
    assert "reward-exploit probes (base model mean reward 0.000)" in report.text()


def test_doctor_flags_a_reward_for_copying_the_worked_example(compose_cfg, planted):
    report = _doctor(compose_cfg, planted, "PaysTheExample")
    assert any(w.startswith("possible reward exploit: 'worked example copied'") and "earn 0.500" in w
               for w in report.warnings), report.warnings
    honest = _doctor(compose_cfg, planted, "HonestWithExample")
    assert re.search(r"worked example copied\s+0\.000", honest.text())  # probed, and earns nothing
    assert not any("exploit" in w for w in honest.warnings), honest.warnings


def test_doctor_flags_a_turn_score_for_copying_the_worked_example(compose_cfg, planted):
    report = _doctor(compose_cfg, planted, "PaysTheExampleTurn")
    assert any(w.startswith("possible turn-credit exploit: score_turn pays a 'worked example copied' first turn")
               and "0.500" in w for w in report.warnings), report.warnings
    honest = _doctor(compose_cfg, planted, "HonestTurns")
    assert re.search(r"turn-credit probes .*\n(.*\n)*\s+worked example copied\s+0\.000", honest.text()), honest.text()
    assert not any("turn-credit exploit" in w for w in honest.warnings), honest.warnings


def test_learnability_recommends_a_group_size(compose_cfg, planted):
    report = _doctor(compose_cfg, planted, "Graded")
    assert "recommendation: generation.num_generations=" in report.text()
    assert not any(w.startswith("the env gives no signal") for w in report.warnings)
    # on known groups: at size 2, 2/3 of groups are flat in expectation; at 3, half: recommend 3, warn about 2
    known = Report()
    _learnability(known, [[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]], [2, 3], training_size=2)
    assert "num_generations=2: flat groups 67%" in known.text() and "num_generations=3: flat groups 50%" in known.text()
    assert "recommendation: generation.num_generations=3" in known.text()
    assert any("generation.num_generations=2, 67% of groups are flat: use 3" in w for w in known.warnings)


def test_flat_share_is_the_exact_chance_a_subgroup_is_flat():
    assert flat_share([1.0, 1.0, 0.0, 0.0], 2) == pytest.approx(2 / 6)
    assert flat_share([1.0, 1.0, 0.0, 0.0], 3) == 0.0
    assert flat_share([0.5, 0.5, 0.5], 2) == 1.0
    assert flat_share([0.0, 1.0, 1.0, 1.0], 3) == pytest.approx(1 / 4)


def test_pass_at_k_and_best_of_k_are_the_exact_chances_over_subsets():
    import itertools
    import statistics

    group = [0.0, 1.0, 0.2, 0.2, 1.0, 0.5]
    for k in range(1, len(group) + 1):  # against brute force over every k-subset of the samples
        subsets = list(itertools.combinations(group, k))
        assert pass_at_k(group, k) == pytest.approx(statistics.fmean(max(c) >= 1.0 for c in subsets))
        assert best_of_k(group, k) == pytest.approx(statistics.fmean(max(c) for c in subsets))
    assert pass_at_k([0.2] * 8, 8) == 0.0 and best_of_k([0.2] * 8, 8) == pytest.approx(0.2)


def test_the_doctor_says_what_training_can_reach():
    known = Report()
    # prompt 1 solved in 1 of 4 samples, prompt 2 never (partial credit only)
    _learnability(known, [[1.0, 0.2, 0.2, 0.0], [0.2, 0.5, 0.0, 0.2]], [2, 4], training_size=4)
    text = known.text()
    assert "pass@1 0.12, pass@2 0.25, pass@4 0.50 (a full score, 1.0)" in text
    assert "best of 4 0.750 (mean reward)" in text  # (1.0 + 0.5) / 2
    assert not any("no sampled completion earned a full score" in w for w in known.warnings)
    never = Report()
    _learnability(never, [[0.2, 0.5, 0.0, 0.2], [0.2, 0.2, 0.0, 0.5]], [2, 4], training_size=4)
    assert any(w.startswith("no sampled completion earned a full score (pass@4 0.00)") for w in never.warnings)


def test_the_doctor_samples_the_same_completions_whatever_the_rng_held(compose_cfg, planted):
    import torch

    def report_lines():
        torch.manual_seed(int(torch.randint(0, 10**6, ()).item()) + 1)  # a different global RNG state each time
        text = _doctor(compose_cfg, planted, "Graded").text()
        timed = ("generated ", "slowest episodes")  # wall-clock figures and the order they put episodes in
        return [line for line in text.splitlines() if not line.startswith(timed)]

    assert report_lines() == report_lines()
