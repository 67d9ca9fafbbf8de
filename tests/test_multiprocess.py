"""Several processes (torchrun, gloo on CPU): SIGTERM to one rank stops every rank after the same
step with one checkpoint, and the MLflow run is KILLED; nothing hangs in a collective."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
from mlflow.tracking import MlflowClient

from test_crash_safety import SLOW_ENV


def _rank_processes(launcher: psutil.Process) -> dict[int, psutil.Process]:
    ranks = {}
    for child in launcher.children(recursive=True):
        try:
            environ = child.environ()
            if "grpo_pipeline" in " ".join(child.cmdline()) and "RANK" in environ:
                ranks[int(environ["RANK"])] = child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return ranks


def test_sigterm_to_one_rank_stops_all_ranks_at_the_same_step(tmp_path):
    (tmp_path / "slow_env.py").write_text(SLOW_ENV)
    run_dir, log = tmp_path / "run", tmp_path / "ranks.log"
    launcher = subprocess.Popen(
        # torchrun starts 2 CPU processes (gloo); `accelerate launch --cpu` would start only one
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "grpo_pipeline",
         "model=tiny", "env=custom", "env._target_=slow_env.SlowEnv",
         "training.max_steps=200", "training.batch_size=2", "generation.num_generations=2",
         "generation.max_new_tokens=4", "eval.enabled=false", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, stdout=open(log, "w"), stderr=subprocess.PIPE, text=True,  # noqa: SIM115
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 400
    while "step 2/200 " not in log.read_text():  # both ranks are training (a step is collective)
        assert launcher.poll() is None, launcher.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "training never started"
        time.sleep(0.1)
    ranks = _rank_processes(psutil.Process(launcher.pid))
    assert set(ranks) == {0, 1}, ranks
    ranks[1].send_signal(signal.SIGTERM)  # only the non-main rank is told to stop

    _, err = launcher.communicate(timeout=300)  # no hang: both ranks leave
    for proc in ranks.values():
        assert not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    assert "Continue with:" in err and f"-m grpo_pipeline resume={run_dir}" in err, err[-3000:]
    checkpoints = list((run_dir / "checkpoints").glob("checkpoint-*"))
    assert len(checkpoints) == 1, checkpoints  # one checkpoint, saved by both ranks at the same step
    step = json.loads((checkpoints[0] / "trainer_state.json").read_text())["global_step"]
    assert 0 < step < 200
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("grpo_pipeline").experiment_id])
    assert [r.info.status for r in runs] == ["KILLED"]  # rank 0 learnt of the signal and closed the run


def test_ranks_started_seconds_apart_compose_one_run_dir(tmp_path):
    """A launcher (here: this test, like torchrun's agent) starts its ranks at different wall-clock seconds;
    each composes hydra.run.dir from the launcher's start time, so the run is not split across two dirs."""
    import re

    def run_dir(rank: int) -> str:
        out = subprocess.run([sys.executable, "-m", "grpo_pipeline", "--cfg", "hydra", "--resolve"], cwd=tmp_path,
                             env=dict(os.environ, LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE="2"),
                             capture_output=True, text=True, timeout=120)
        return re.search(r"dir: (outputs/runs/\S+)", out.stdout).group(1)

    first = run_dir(0)
    time.sleep(1.2)  # past a second boundary: ${now:...} would differ
    assert run_dir(1) == first
    single = subprocess.run([sys.executable, "-m", "grpo_pipeline", "--cfg", "hydra", "--resolve"], cwd=tmp_path,
                            env={k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")},
                            capture_output=True, text=True, timeout=120).stdout
    assert re.search(r"dir: outputs/runs/\S+", single).group(0) != f"dir: {first}"  # one process: its own clock
