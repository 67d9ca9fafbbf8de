"""A user's own run, trusted: a resume runs the run's own config (and refuses silent changes), the stop message is
a command that runs as printed, and a run dir holds one run's data."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from grpo_pipeline.errors import ConfigError
from grpo_pipeline.training.checkpoints import MARKER
from grpo_pipeline.training.run_dir import claim, config_changes, resume_overrides

# Scores 0.25 with marker=b (0.75 otherwise): the reward curve shows which env config each step ran. With
# STOP_AT_EPISODE set (the first start only), the env sends the process SIGINT once, as Ctrl-C would.
MARKED_ENV = """
import os, signal
from datasets import Dataset
class MarkedEnv:
    thread_safe = False
    def __init__(self, marker: str = "a"):
        self.marker, self.calls = marker, 0
    def build_dataset(self, tokenizer):
        return Dataset.from_list([{"prompt": f"Count to {i}", "i": i} for i in range(40)])
    def score_episode(self, model, tokenizer, completion, i):
        self.calls += 1
        if self.calls == int(os.environ.get("STOP_AT_EPISODE", "0")):
            os.kill(os.getpid(), signal.SIGINT)
        return 0.25 if self.marker == "b" else 0.75
"""
ARGS = ["model=tiny", "env=custom", "env._target_=marked_env.MarkedEnv", "+env.marker=b", "loss.kl_coef=0.04",
        "training.max_steps=4", "training.save_steps=1", "training.batch_size=4", "generation.num_generations=2",
        "generation.oversample=1", "generation.max_new_tokens=4", "eval.enabled=false"]


def _cli(project: Path, *args: str, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grpo_pipeline", *args], cwd=project, capture_output=True,
                          text=True, timeout=600, env={**os.environ, **(extra_env or {})})


def _project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    project.mkdir()
    (project / "marked_env.py").write_text(MARKED_ENV)
    return project


def _runs(project: Path):
    client = MlflowClient(f"sqlite:///{project / 'outputs' / 'mlflow.db'}")
    return client, client.search_runs([client.get_experiment_by_name("grpo_pipeline").experiment_id])


def _history(client, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def test_resume_runs_the_runs_own_config_and_refuses_a_silent_change(tmp_path):
    project = _project(tmp_path)
    run_dir = project / "outputs" / "run"
    first = _cli(project, *ARGS, f"hydra.run.dir={run_dir}", extra_env={"STOP_AT_EPISODE": "6"})  # in step 2
    assert first.returncode == 130, first.stderr[-3000:]
    printed = first.stderr.split("Continue with:\n", 1)[1].splitlines()[0].strip()
    assert "resume=" in printed and "model=tiny" not in printed  # the run's config is not repeated: it is stored

    # the same command with a changed loss.kl_coef is refused before any weights load, naming both values
    changed = subprocess.run(f"{printed} loss.kl_coef=0.1", shell=True, capture_output=True, text=True, timeout=300)
    assert changed.returncode == 2, changed.stderr[-3000:]
    assert "loss.kl_coef: 0.04 -> 0.1" in changed.stderr and "resume_allow=[loss.kl_coef]" in changed.stderr

    resumed = subprocess.run(printed, shell=True, capture_output=True, text=True, timeout=600)  # as printed
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    client, runs = _runs(project)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    run_id = runs[0].info.run_id
    assert _history(client, run_id, "reward") == {1: 0.25, 2: 0.25, 3: 0.25, 4: 0.25}  # marker=b throughout
    assert sorted(_history(client, run_id, "kl")) == [1, 2, 3, 4]  # TRL logs kl only with kl_coef (beta) != 0
    stored = yaml.safe_load((run_dir / "resolved_config.yaml").read_text())
    assert stored["loss"]["kl_coef"] == 0.04 and stored["env"]["marker"] == "b"
    assert not (run_dir / "config_changes.yaml").exists()


def test_an_allowed_change_is_recorded_with_its_step(tmp_path):
    project = _project(tmp_path)
    run_dir = project / "outputs" / "run"
    first = _cli(project, *ARGS, "training.max_steps=2", f"hydra.run.dir={run_dir}")
    assert first.returncode == 0, first.stderr[-3000:]
    again = _cli(project, f"resume={run_dir}", "training.max_steps=3", "loss.kl_coef=0.1",
                 "resume_allow=[loss.kl_coef]")
    assert again.returncode == 0, again.stderr[-3000:]
    changes = yaml.safe_load((run_dir / "config_changes.yaml").read_text())
    assert changes == [{"step": 2, "at": changes[0]["at"], "changes": {
        "loss.kl_coef": {"old": 0.04, "new": 0.1}, "training.max_steps": {"old": 2, "new": 3}}}]
    client, runs = _runs(project)
    assert len(runs) == 1 and "step 2: loss.kl_coef 0.04 -> 0.1" in runs[0].data.tags["config_changes"]
    assert yaml.safe_load((run_dir / "resolved_config.yaml").read_text())["loss"]["kl_coef"] == 0.04  # kept
    assert sorted(_history(client, runs[0].info.run_id, "reward")) == [1, 2, 3]


def test_a_second_run_never_mixes_into_another_runs_dir(tmp_path):
    project = _project(tmp_path)
    run_dir = project / "outputs" / "fixed"
    fixed = [*ARGS, "training.max_steps=1", "training.save_steps=0", f"hydra.run.dir={run_dir}"]
    assert _cli(project, *fixed).returncode == 0

    again = _cli(project, *fixed)  # the same fixed dir, a new run: refused, nothing written
    assert again.returncode == 2 and "already holds the data of run" in again.stderr, again.stderr[-2000:]
    assert "resume=auto moves its files aside" in again.stderr

    auto = _cli(project, *fixed, "resume=auto", "env.marker=a", "training.max_steps=2")  # no checkpoint: afresh
    assert auto.returncode == 0, auto.stderr[-3000:]
    previous = list((run_dir / "previous").iterdir())
    assert len(previous) == 1 and (previous[0] / "episodes.jsonl").exists()

    client, runs = _runs(project)
    assert len(runs) == 2
    by_reward = {tuple(sorted(_history(client, r.info.run_id, "reward").items())): r for r in runs}
    assert set(by_reward) == {((1, 0.25),), ((1, 0.75), (2, 0.75))}  # each MLflow run holds its own steps only
    for ledger, steps, reward in ((previous[0] / "episodes.jsonl", {1}, 0.25), (run_dir / "episodes.jsonl", {1, 2}, 0.75)):
        lines = [json.loads(x) for x in ledger.read_text().splitlines()]
        assert {x["step"] for x in lines} == steps and {x["reward"] for x in lines} == {reward}


def _fake_run(run_dir: Path, uid: str, steps: list[int], marked_by: str | None = None) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"uid": uid, "created": "now", "overrides": []}))
    (run_dir / "mlflow_run_id").write_text(f"mlflow-{uid}")
    for step in steps:
        folder = run_dir / "checkpoints" / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / MARKER).write_text(json.dumps({"run_uid": marked_by or uid, "step": step}))


def test_a_resume_takes_only_its_own_runs_checkpoints(tmp_path):
    _fake_run(tmp_path / "mine", "r1", [2, 4])
    record, found = claim(tmp_path / "mine", str(tmp_path / "mine"))
    assert record["uid"] == "r1" and [p.name for p in found] == ["checkpoint-4", "checkpoint-2"]
    _fake_run(tmp_path / "copied", "r2", [6], marked_by="r1")  # another run's checkpoint copied in
    with pytest.raises(ConfigError, match="checkpoint-6.*belong to another run"):
        claim(tmp_path / "copied", str(tmp_path / "copied"))
    with pytest.raises(ConfigError, match="already holds the data of run r1"):
        claim(tmp_path / "mine", None)
    assert claim(tmp_path / "empty", None) == (None, [])


def test_resume_overrides_keep_the_runs_own_and_let_the_command_win():
    record = {"overrides": ["env=hotel", "+env.marker=b", "loss.kl_coef=0.04", "output_dir=/x", "+env.api_key=***"]}
    with pytest.raises(ConfigError, match=r"env.api_key was a secret.*oc.env:API_KEY"):
        resume_overrides(record, ["resume=/r"])
    merged = resume_overrides(record, ["resume=/r", "env.marker=c", "+env.api_key=${oc.env:API_KEY}"])
    assert merged == ["env=hotel", "loss.kl_coef=0.04", "++env.marker=c", "+env.api_key=${oc.env:API_KEY}"]
    assert config_changes({"a": {"b": 1, "c": "***"}, "output_dir": "x"}, {"a": {"b": 2, "c": "real"}}) == {
        "a.b": (1, 2)}


def test_the_stop_message_names_the_launch_dir_and_python(tmp_path):
    from grpo_pipeline.training.run_dir import resume_command, write_record

    write_record(tmp_path, ["+env.api_key=sk-abcdef12", "loss=grpo"], "/some/project", None, None)
    command = resume_command(tmp_path)
    assert re.match(rf"cd /some/project && {re.escape(sys.executable)} -m grpo_pipeline resume={tmp_path}", command)
    assert "'+env.api_key=${oc.env:API_KEY}'" in command and "sk-abc" not in command


def test_a_resume_falls_back_when_the_newest_checkpoint_fails_to_load(tmp_path):
    project = _project(tmp_path)
    run_dir = project / "outputs" / "run"
    assert _cli(project, *ARGS, "training.max_steps=2", f"hydra.run.dir={run_dir}").returncode == 0
    optimizer = run_dir / "checkpoints" / "checkpoint-2" / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:100])  # a disk that lost the end of the file
    again = _cli(project, f"resume={run_dir}", "training.max_steps=3")
    assert again.returncode == 0, again.stderr[-3000:]
    printed = again.stdout + again.stderr
    assert "checkpoint-2 fails to load" in printed and "falling back" in printed
    client, runs = _runs(project)
    assert len(runs) == 1 and sorted(_history(client, runs[0].info.run_id, "reward")) == [1, 2, 3]


def test_outputs_are_replaced_whole_or_not_at_all(tmp_path):
    from grpo_pipeline.training.checkpoints import replace_dir_durably, write_durably

    target = tmp_path / "model"
    replace_dir_durably(target, lambda d: (d.mkdir(), (d / "w.bin").write_text("old")))

    def crash(d):
        d.mkdir()
        (d / "w.bin").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        replace_dir_durably(target, crash)
    assert (target / "w.bin").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    replace_dir_durably(target, lambda d: (d.mkdir(), (d / "w.bin").write_text("new")))
    assert (target / "w.bin").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    write_durably(tmp_path / "summary.json", "{}")
    assert (tmp_path / "summary.json").read_text() == "{}" and not list(tmp_path.glob(".*tmp"))


def test_best_keeps_only_the_weights_that_can_still_be_chosen(tmp_path):
    from grpo_pipeline.evaluation.best_model import Validation

    best = tmp_path / "best"
    best.mkdir()
    for step in (5, 10, 15):
        (best / f"step-{step}.safetensors").write_text("w")
    state = {"stateful_callbacks": {"Validation": {"attributes": {"best_step": 10}}}}
    (tmp_path / "checkpoints" / "checkpoint-12").mkdir(parents=True)
    (tmp_path / "checkpoints" / "checkpoint-12" / "trainer_state.json").write_text(json.dumps(state))
    validation = Validation(lambda: {}, 5, 0, best, policy=None)
    validation.best_step = 15
    validation.prune()
    assert sorted(p.name for p in best.iterdir()) == ["step-10.safetensors", "step-15.safetensors"]
