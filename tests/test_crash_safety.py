"""Crash safety: kill -9 at many moments and resume (every step in MLflow exactly once, the checkpoint's
optimizer/scheduler/RNG state restored by value); SIGTERM saves a checkpoint and marks the run KILLED."""

import copy
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

import grpo_pipeline

SLOW_ENV = """
import os, time
from pathlib import Path
from datasets import Dataset

if os.environ.get("SLOW_SAVE_DIR"):  # make checkpoint writes slow, so a test can kill in the middle of one
    from transformers import Trainer
    _save_rng = Trainer._save_rng_state
    def _slow_save_rng(self, output_dir):
        Path(os.environ["SLOW_SAVE_DIR"], f"saving-{self.state.global_step}").touch()
        time.sleep(3)
        return _save_rng(self, output_dir)
    Trainer._save_rng_state = _slow_save_rng

class SlowEnv:
    thread_safe = False
    def build_dataset(self, tokenizer):
        return Dataset.from_list([{"prompt": f"Count to {i}", "i": i} for i in range(64)])
    def score_episode(self, model, tokenizer, completion, i):
        time.sleep(0.1)
        return (len(completion) % 7) / 6  # varied scores, so the policy really changes
"""
STEPS = 12
ARGS = ["model=tiny", "env=custom", "env._target_=slow_env.SlowEnv", f"training.max_steps={STEPS}",
        "training.save_steps=2", "training.batch_size=4", "generation.num_generations=2",
        "generation.max_new_tokens=8", "eval.enabled=false", "training.learning_rate=0.05",
        "tracking.flush_every_s=0.1"]
KEYS = ("reward", "loss", "env/failures", "completions/mean_length")


def _project(tmp_path: Path) -> tuple[Path, Path]:
    project = tmp_path / "project"
    project.mkdir()
    (project / "slow_env.py").write_text(SLOW_ENV)
    return project, project / "outputs" / "run"


def _start(project: Path, run_dir: Path, *extra: str, env: dict | None = None, log: Path | None = None):
    import os

    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 (closed with the process)
    return subprocess.Popen([sys.executable, "-m", "grpo_pipeline", *ARGS, f"hydra.run.dir={run_dir}", *extra],
                            cwd=project, stdout=out, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def _wait(condition, proc: subprocess.Popen, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"exited before {what}: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.02)


def _complete(checkpoint: Path) -> bool:
    from grpo_pipeline.training.checkpoints import is_complete

    return is_complete(checkpoint)  # its marker is written once every file of it is on disk


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def _client(project: Path):
    client = MlflowClient(f"sqlite:///{project / 'outputs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("grpo_pipeline")
    return client, client.search_runs([exp.experiment_id])


def _printed_step(log: Path, step: int) -> bool:
    return f"step {step}/{STEPS} " in log.read_text()


def test_kill9_at_many_moments_then_resume_keeps_every_step_exactly_once(tmp_path):
    from grpo_pipeline.training.checkpoints import resumable

    project, run_dir = _project(tmp_path)
    ckpt = run_dir / "checkpoints"
    resume = [f"resume={run_dir}"]
    rng = random.Random(0)
    kills = []

    # 1. right after checkpoint-2 is complete: before its metrics can have been written
    proc = _start(project, run_dir)
    _wait(lambda: _complete(ckpt / "checkpoint-2"), proc, "checkpoint-2")
    _kill(proc)
    kills.append("right after checkpoint-2")

    # 2. in the middle of writing checkpoint-4 (weights and optimizer on disk, no trainer_state.json yet)
    proc = _start(project, run_dir, *resume, env={"SLOW_SAVE_DIR": str(tmp_path)})
    _wait(lambda: (tmp_path / "saving-4").exists(), proc, "checkpoint-4 being written")
    assert (ckpt / "checkpoint-4").is_dir() and not (ckpt / "checkpoint-4" / "trainer_state.json").exists()
    _kill(proc)
    kills.append("while writing checkpoint-4")

    # 3-5. at a random moment after a random step of a resumed run (between checkpoints, or just after one)
    for n in range(3):
        done = int(resumable(run_dir, None)[0].name.split("-")[1])
        step = rng.randint(done + 1, min(done + 3, STEPS - 1))
        log = tmp_path / f"resume{n}.log"
        proc = _start(project, run_dir, *resume, log=log)
        _wait(lambda: _printed_step(log, step), proc, f"step {step}")  # noqa: B023
        time.sleep(rng.uniform(0, 0.5))
        _kill(proc)
        kills.append(f"after step {step} (resumed from {done})")

    final = _start(project, run_dir, *resume)
    _, err = final.communicate(timeout=600)
    assert final.returncode == 0, err[-3000:]

    client, runs = _client(project)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"  # one MLflow run across all kills
    for key in KEYS:
        steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, key)]
        assert sorted(steps) == list(range(1, STEPS + 1)), (key, sorted(steps), kills)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS


def test_resume_restores_the_checkpoints_optimizer_scheduler_and_rng_by_value(tmp_path, monkeypatch):
    from trl import GRPOTrainer

    project, run_dir = _project(tmp_path)
    proc = _start(project, run_dir, "training.max_steps=4")
    _wait(lambda: _complete(run_dir / "checkpoints" / "checkpoint-2"), proc, "checkpoint-2")
    _kill(proc)
    checkpoint = run_dir / "checkpoints" / "checkpoint-2"

    seen = {}
    load_state, load_rng = GRPOTrainer._load_optimizer_and_scheduler, GRPOTrainer._load_rng_state

    def capture_state(self, ckpt):
        load_state(self, ckpt)
        seen["optimizer"] = copy.deepcopy(self.optimizer.state_dict())  # training goes on updating it in place
        seen["scheduler"] = copy.deepcopy(self.lr_scheduler.state_dict())

    def capture_rng(self, ckpt):
        load_rng(self, ckpt)
        seen["step"] = self.state.global_step
        seen["rng"] = (torch.get_rng_state(), random.getstate())

    monkeypatch.setattr(GRPOTrainer, "_load_optimizer_and_scheduler", capture_state)
    monkeypatch.setattr(GRPOTrainer, "_load_rng_state", capture_rng)
    monkeypatch.chdir(project)
    result = grpo_pipeline.train([*ARGS, "training.max_steps=4", f"output_dir={tmp_path / 'unused'}",
                                  f"resume={run_dir}"])
    assert result.steps == 4 and result.run_dir == str(run_dir)

    assert seen.get("step") == 2, "resume did not continue from checkpoint-2"  # not a silent restart at 0
    saved_opt = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert seen["optimizer"]["param_groups"][0]["lr"] == saved_opt["param_groups"][0]["lr"]
    assert set(seen["optimizer"]["state"]) == set(saved_opt["state"]) and saved_opt["state"]
    for idx, state in saved_opt["state"].items():
        for name, value in state.items():
            assert torch.equal(seen["optimizer"]["state"][idx][name], value), (idx, name)
    saved_sched = torch.load(checkpoint / "scheduler.pt", weights_only=True)
    assert seen["scheduler"]["last_epoch"] == saved_sched["last_epoch"] == 2
    rng = torch.load(checkpoint / "rng_state.pth", weights_only=False)
    assert torch.equal(seen["rng"][0], rng["cpu"]) and seen["rng"][1] == rng["python"]

    client, runs = _client(project)
    steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "reward")]
    assert sorted(steps) == [1, 2, 3, 4]


def test_sigterm_saves_a_checkpoint_and_marks_the_run_killed(tmp_path):
    project, run_dir = _project(tmp_path)
    log = tmp_path / "run.log"
    proc = _start(project, run_dir, "training.save_steps=100", "training.max_steps=50", log=log)
    _wait(lambda: "step 1/50 " in log.read_text(), proc, "the first step")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert f"-m grpo_pipeline resume={run_dir}" in err and "Traceback" not in err
    checkpoints = list((run_dir / "checkpoints").glob("checkpoint-*"))
    assert len(checkpoints) == 1 and (checkpoints[0] / "optimizer.pt").exists()
    client, runs = _client(project)
    assert [r.info.status for r in runs] == ["KILLED"]
    step = int(checkpoints[0].name.split("-")[1])
    assert sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "reward")) == list(
        range(1, step + 1))


@pytest.mark.parametrize("bad", ["garbage", "", '{"run_uid": "r1", "step": 2}'])
def test_a_checkpoint_counts_only_with_its_own_marker(tmp_path, bad):
    from grpo_pipeline.training.checkpoints import MARKER, remove_incomplete, resumable

    for step in (2, 4):
        (tmp_path / "checkpoints" / f"checkpoint-{step}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"checkpoint-{step}" / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
    (tmp_path / "checkpoints" / "checkpoint-2" / MARKER).write_text('{"run_uid": "r1", "step": 2}')
    (tmp_path / "checkpoints" / "checkpoint-4" / MARKER).write_text(bad)  # cut short, or naming another step
    assert [p.name for p in resumable(tmp_path, "r1")] == ["checkpoint-2"]
    assert resumable(tmp_path, "another run") == []  # never another run's checkpoint
    remove_incomplete(tmp_path)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["checkpoint-2"]
