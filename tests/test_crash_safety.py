"""Crash safety: kill -9 then resume into the same MLflow run; SIGTERM saves a checkpoint and marks KILLED."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

SLOW_ENV = """
import time
from datasets import Dataset
class SlowEnv:
    thread_safe = False
    def build_dataset(self, tokenizer):
        return Dataset.from_list([{"prompt": f"Count to {i}", "i": i} for i in range(64)])
    def score_episode(self, model, tokenizer, completion, i):
        time.sleep(0.15)
        return (len(completion) % 7) / 6  # varied scores, so the policy really changes
"""


def _start(project: Path, run_dir: Path, *extra: str) -> subprocess.Popen:
    args = ["model=tiny", "env=custom", "env._target_=slow_env.SlowEnv", "training.max_steps=6",
            "training.save_steps=2", "training.batch_size=4", "generation.num_generations=2",
            "generation.max_new_tokens=8", "eval.enabled=false", "training.learning_rate=0.05",
            f"hydra.run.dir={run_dir}", *extra]
    return subprocess.Popen([sys.executable, "-m", "grpo_pipeline", *args], cwd=project, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def _project(tmp_path: Path) -> tuple[Path, Path]:
    project = tmp_path / "project"
    project.mkdir()
    (project / "slow_env.py").write_text(SLOW_ENV)
    return project, project / "outputs" / "run"


def _runs(project: Path):
    client = MlflowClient(f"sqlite:///{project / 'outputs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("grpo_pipeline")
    return client, client.search_runs([exp.experiment_id])


def test_sigkill_then_resume_continues_the_same_run(tmp_path):
    project, run_dir = _project(tmp_path)
    proc = _start(project, run_dir)
    _wait_for(run_dir / "checkpoints" / "checkpoint-2" / "trainer_state.json", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "summary.json").exists()

    resumed = _start(project, tmp_path / "ignored", f"resume={run_dir}")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and len(summary["reward_curve"]) >= 6

    client, runs = _runs(project)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"  # the same MLflow run, no duplicate
    steps = {m.step for m in client.get_metric_history(runs[0].info.run_id, "reward")}
    assert steps == {1, 2, 3, 4, 5, 6}  # continuous across the kill

    adapter = load_file(run_dir / "model" / "adapter_model.safetensors")
    lora_b = [t for name, t in adapter.items() if "lora_B" in name]
    assert lora_b and any(t.abs().sum() > 0 for t in lora_b)  # LoRA B starts at zero: the model moved


def test_sigterm_saves_a_checkpoint_and_marks_the_run_killed(tmp_path):
    project, run_dir = _project(tmp_path)
    proc = _start(project, run_dir, "training.save_steps=100", "training.max_steps=50")
    _wait_for(run_dir / "mlflow_run_id", proc)
    time.sleep(3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert f"Continue with: resume={run_dir}" in err and "Traceback" not in err
    checkpoints = list((run_dir / "checkpoints").glob("checkpoint-*"))
    assert len(checkpoints) == 1 and (checkpoints[0] / "optimizer.pt").exists()
    _, runs = _runs(project)
    assert [r.info.status for r in runs] == ["KILLED"]
