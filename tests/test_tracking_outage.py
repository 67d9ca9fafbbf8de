"""A tracking server that goes away: a restart costs nothing (retried, warned once, every step written once);
one that stays down past tracking.outage_grace_s stops the run with a checkpoint and a resume line."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from test_crash_safety import SLOW_ENV

ARGS = ["model=tiny", "env=custom", "env._target_=slow_env.SlowEnv", "training.batch_size=4",
        "generation.num_generations=2", "generation.max_new_tokens=8", "eval.enabled=false",
        "tracking.flush_every_s=0.1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


class Server:
    """`mlflow server` on a sqlite file, started and killed for real."""

    def __init__(self, tmp_path: Path):
        self.db, self.port = tmp_path / "server.db", _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{self.db}",
             "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
             "--default-artifact-root", (self.db.parent / "server-artifacts").as_uri()],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 180
        while not _up(self.url):
            assert self.proc.poll() is None, "mlflow server exited"
            assert time.monotonic() < deadline, "mlflow server did not come up"
            time.sleep(0.3)

    def kill(self) -> None:
        """The server and every worker it started (uvicorn, huey consumers), for real."""
        if self.proc is None or self.proc.poll() is not None:
            return
        tree = [self.proc.pid] + [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        while _up(self.url):
            time.sleep(0.1)


@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path)
    yield s
    s.kill()


def _train(project: Path, server: Server, *extra: str, output: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "grpo_pipeline", *ARGS, f"tracking.tracking_uri={server.url}",
         f"hydra.run.dir={project / 'run'}", *extra],
        cwd=project, stdout=open(output, "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
        env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _reward_steps(server: Server) -> list[int]:
    client = MlflowClient(server.url)
    runs = client.search_runs([client.get_experiment_by_name("grpo_pipeline").experiment_id])
    assert len(runs) == 1
    return sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "reward"))


def _wait_for_text(path: Path, text: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        assert proc.poll() is None or text in path.read_text(), path.read_text()[-3000:]
        assert time.monotonic() < deadline, f"{text!r} never appeared"
        time.sleep(0.05)


def _project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    project.mkdir()
    (project / "slow_env.py").write_text(SLOW_ENV)
    return project


def test_a_server_restart_mid_run_loses_nothing_and_warns_once(tmp_path, server):
    project = _project(tmp_path)
    server.start()
    err = tmp_path / "train.err"
    proc = _train(project, server, "training.max_steps=12", output=err)
    deadline = time.monotonic() + 300
    while not (project / "run" / "mlflow_run_id").exists():
        assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
        time.sleep(0.05)
    server.kill()
    _wait_for_text(err, "Writing metrics to MLflow failed", proc)
    server.start()
    assert proc.wait(timeout=600) == 0, err.read_text()[-3000:]

    text = err.read_text()
    assert text.count("Writing metrics to MLflow failed") == 1  # warned once, however many retries
    assert "MLflow is reachable again" in text
    assert _reward_steps(server) == list(range(1, 13))  # every step, exactly once


@pytest.mark.slow  # ~2 min (waits out the grace period); make test-slow runs it
def test_a_server_down_past_the_grace_period_stops_with_a_checkpoint_then_resumes(tmp_path, server):
    project = _project(tmp_path)
    server.start()
    err = tmp_path / "train.err"
    proc = _train(project, server, "training.max_steps=40", "tracking.outage_grace_s=3", output=err)
    deadline = time.monotonic() + 300
    while not (project / "run" / "mlflow_run_id").exists():
        assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
        time.sleep(0.05)
    server.kill()
    assert proc.wait(timeout=600) == 3, err.read_text()[-3000:]
    text = err.read_text()
    assert "tracking.outage_grace_s=3" in text and f"Continue with: resume={project / 'run'}" in text
    checkpoints = list((project / "run" / "checkpoints").glob("checkpoint-*"))
    assert len(checkpoints) == 1
    stopped_at = int(checkpoints[0].name.split("-")[1])
    assert stopped_at < 40

    server.start()
    resumed = _train(project, server, "training.max_steps=40", f"resume={project / 'run'}",
                     output=tmp_path / "resume.err")
    assert resumed.wait(timeout=600) == 0, (tmp_path / "resume.err").read_text()[-3000:]
    assert _reward_steps(server) == list(range(1, 41))  # the outage's steps came from the checkpoint
