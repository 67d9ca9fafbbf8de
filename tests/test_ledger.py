"""The episode ledger: every training and held-out episode of a run in episodes.jsonl and an MLflow table,
read back by `grpo_pipeline.tools.episodes`, re-scored by `grpo_pipeline.tools.rescore` without weights."""

import json
import statistics
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

import grpo_pipeline.models as models
import grpo_pipeline.recipe as recipe
from conftest import tiny_overrides
from grpo_pipeline.models import build_tiny_tokenizer
from grpo_pipeline.tools import episodes, rescore
from grpo_pipeline.tracking.ledger import Ledger, read


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from grpo_pipeline.config import CONFIG_DIR

    tmp_path = tmp_path_factory.mktemp("ledger")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[*tiny_overrides(tmp_path, ["env=arithmetic", "env.num_samples=60"]),
                                          "eval.enabled=true", "eval.num_prompts=5", "eval.val_prompts=5",
                                          "eval.every_steps=1"])
    GlobalHydra.instance().clear()
    result = recipe.train(cfg, launch_dir=str(tmp_path))
    return tmp_path, result


def test_every_episode_is_recorded_with_what_grpo_saw(finished_run):
    tmp_path, result = finished_run
    entries = read(tmp_path / "run" / "episodes.jsonl")
    train = [e for e in entries if e["split"] == "train"]
    assert [e["step"] for e in train] == [1] * 4 + [2] * 4
    for e in train:
        assert e["reward"] == e["rewards"]["env"] and e["advantage"] is not None and e["failure"] is None
        assert "answer" in e["row"] and e["seconds"] is not None and len(e["prompt_id"]) == 10
        assert "<answer>" in e["prompt"]  # the prompt as the model saw it: rendered, worked example included
        assert not e["completion"].startswith("[assistant]") and e["messages"] is None  # the text the env scored
    # the ledger's rewards are the ones TRL trained on: per step they average to MLflow's `reward`
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    logged = {m.step: m.value for m in client.get_metric_history(result.mlflow_run_id, "reward")}
    for step in (1, 2):
        assert statistics.fmean(e["reward"] for e in train if e["step"] == step) == pytest.approx(logged[step], abs=1e-5)
    # loss=dapo masks episodes cut by the token budget: the ledger says which (single-turn: no EOS = TRL's "clipped")
    clipped = {m.step: m.value for m in client.get_metric_history(result.mlflow_run_id, "completions/clipped_ratio")}
    for step in (1, 2):
        assert statistics.fmean(e["masked"] for e in train if e["step"] == step) == pytest.approx(clipped[step])
    held = {(e["split"], e["step"]) for e in entries if e["split"] != "train"}
    assert held == {("test_before", 0), ("val", 1), ("val", 2), ("test_after", 2)}
    assert sum(e["split"] == "test_after" for e in entries) == 5
    test_ids = {e["prompt_id"] for e in entries if e["split"] == "test_before"}
    assert test_ids == {e["prompt_id"] for e in entries if e["split"] == "test_after"}
    assert not test_ids & {e["prompt_id"] for e in train}
    # the MLflow table: every row, and the run's summary reports what recording cost
    path = client.download_artifacts(result.mlflow_run_id, "episodes.json", str(tmp_path / "dl"))
    table = json.loads(Path(path).read_text())
    assert len(table["data"]) == len(entries) and "completion" in table["columns"]
    # registered as a table: what makes the MLflow UI show it as one (and mlflow.load_table find it)
    logged = json.loads(client.get_run(result.mlflow_run_id).data.tags["mlflow.loggedArtifacts"])
    assert {"path": "episodes.json", "type": "table"} in logged
    assert 0 < json.loads((tmp_path / "run" / "summary.json").read_text())["ledger_seconds"] < 5


def test_episodes_cli_filters_and_follows_a_prompt(finished_run, capsys):
    tmp_path, _ = finished_run
    run = str(tmp_path / "run")
    episodes.main([run])
    out = capsys.readouterr().out
    assert "test_before      0        5" in out and "train            2        4" in out
    step2 = [e for e in read(tmp_path / "run" / "episodes.jsonl") if e["split"] == "train" and e["step"] == 2]
    columns = out.split("train            2")[1].split()  # episodes, mean reward, failures, masked
    assert columns[3] == str(sum(e["masked"] for e in step2))
    episodes.main([run, "--split", "train", "--steps", "2", "--limit", "0"])
    assert capsys.readouterr().out.count("[train step 2]") == 4
    entries = read(tmp_path / "run" / "episodes.jsonl")
    pid = next(e["prompt_id"] for e in entries if e["split"] == "test_before")
    episodes.main([run, "--prompt", pid[:6]])
    out = capsys.readouterr().out
    assert "== FIRST: test_before step 0" in out and "== LAST: test_after step 2" in out
    episodes.main([run, "--min-score", "2"])
    assert "0 episode(s) matched" in capsys.readouterr().err


def test_rescore_with_another_reward_loads_no_weights(finished_run, capsys, monkeypatch):
    tmp_path, _ = finished_run

    def no_weights(*_, **__):
        raise AssertionError("rescore must not load weights")

    monkeypatch.setattr(models, "load_model", no_weights)
    rescore.main([str(tmp_path / "run"), "reward=length_penalty", "reward.components.length_penalty.weight=0.5"])
    out = capsys.readouterr().out
    rows = {tuple(line.split()[:2]): line.split() for line in out.splitlines()[2:]}
    entries = read(tmp_path / "run" / "episodes.jsonl")
    for step in (1, 2):  # completions of <= 8 tokens are under the 200-token target: +0.5 each
        old = statistics.fmean(e["reward"] for e in entries if e["split"] == "train" and e["step"] == step)
        split, _, n, old_mean, new_mean, changed, failed = rows[("train", str(step))]
        assert (n, changed, failed) == ("4", "4", "0")
        assert float(old_mean) == pytest.approx(old, abs=1e-3) and float(new_mean) == pytest.approx(old + 0.5, abs=1e-3)
    assert rows[("test_after", "2")][5:7] == ["0", "0"]  # held-out scores are the env's alone: unchanged


def test_rescore_an_env_option(finished_run, capsys):
    tmp_path, _ = finished_run
    entries, new = rescore.rescore(tmp_path / "run", ["env.format_weight=0.0", "env.answer_weight=1.0"])
    assert len(entries) == len(new) > 8
    for e, n in zip(entries, new, strict=True):  # without format credit only a right answer scores (then 1.0)
        assert e["reward"] in (0.0, 0.2, 0.8, 1.0) and n["reward"] == (1.0 if e["reward"] >= 0.8 else 0.0)


def test_a_resumed_run_drops_the_steps_after_its_checkpoint(tmp_path):
    ledger = Ledger(tmp_path, build_tiny_tokenizer(), max_per_step=64, max_chars=100)
    for step in (1, 2, 3):
        ledger.record("train", step, [f"q{step}"], [f"a{step}"], {"env": [0.5]})
    ledger.record("val", 3, ["v"], ["x"], {"env": [1.0]})
    ledger.record("test_before", 0, ["t"], ["y"], {"env": [0.0]})
    with ledger.path.open("a") as f:
        f.write('{"split": "train", "st')  # a line a kill cut short
    assert ledger.truncate_after(2) == 3
    kept = [(e["split"], e["step"]) for e in read(ledger.path)]
    assert kept == [("train", 1), ("train", 2), ("test_before", 0)]


def test_a_big_batch_is_sampled_to_the_cap(tmp_path):
    ledger = Ledger(tmp_path, build_tiny_tokenizer(), max_per_step=3, max_chars=5)
    ledger.record("train", 1, [f"q{i}" for i in range(10)], ["long completion"] * 10, {"env": [0.1] * 10})
    ledger.record("test_after", 1, [f"q{i}" for i in range(10)], ["c"] * 10, {"env": [0.1] * 10})
    entries = read(ledger.path)
    assert sum(e["split"] == "train" for e in entries) == 3 and sum(e["split"] == "test_after" for e in entries) == 10
    assert all(len(e["completion"]) <= 5 for e in entries)


def test_rescore_says_what_code_the_run_dir_makes_it_import_and_from_where(finished_run, capsys):
    tmp_path, _ = finished_run
    rescore.rescore(tmp_path / "run", [])
    err = capsys.readouterr().err
    assert "rescore imports and runs the code" in err and "Rescore only run dirs you trust" in err
    assert "env._target_=grpo_pipeline.envs.arithmetic.ArithmeticEnv" in err
    assert f"modules looked up in {tmp_path}" in err  # the run's launch dir (run.json), not the working dir


def test_the_read_only_tools_do_not_import_from_the_working_directory(finished_run, tmp_path):
    import subprocess
    import sys

    run_dir, _ = finished_run
    (tmp_path / "statistics.py").write_text("raise ImportError('the working directory shadowed the stdlib')\n")
    done = subprocess.run([sys.executable, "-m", "grpo_pipeline.tools.episodes", str(run_dir / "run")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "train" in done.stdout
