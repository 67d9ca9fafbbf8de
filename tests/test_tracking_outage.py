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


def test_a_permanent_store_error_is_not_retried_for_the_grace_period():
    import errno

    from grpo_pipeline.tracking.mlflow_run import TrackingError, retry

    calls = []

    def unwritable():
        calls.append(1)
        raise PermissionError(errno.EACCES, "Permission denied", "/srv/mlartifacts")

    started = time.monotonic()
    with pytest.raises(TrackingError, match="Permission denied.*not retried"):
        retry(unwritable, grace_s=600, what="logging artifact summary.json")
    assert len(calls) == 1 and time.monotonic() - started < 5


def test_resuming_into_a_store_that_lacks_the_run_says_which_store_at_once(tmp_path):
    from grpo_pipeline.config.schema import TrackingConfig
    from grpo_pipeline.tracking.mlflow_run import Tracker, TrackingError

    tracker = Tracker(TrackingConfig(tracking_uri=f"sqlite:///{tmp_path / 'other.db'}", outage_grace_s=600), tmp_path)
    started = time.monotonic()
    with pytest.raises(TrackingError, match=r"MLflow run 0123abcd \(run_id.txt\) is not in sqlite:///.*other.db"):
        tracker.resume("0123abcd")
    assert time.monotonic() - started < 30  # not 600 s of retries


def test_an_artifact_store_failing_at_the_end_keeps_the_run_finished_with_its_outputs(compose_cfg, tmp_path,
                                                                                     monkeypatch, caplog):
    import errno

    import grpo_pipeline.recipe as recipe
    from conftest import tiny_overrides

    def refuse(self, run_id, local_path, artifact_path=None):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "mlartifacts"))

    monkeypatch.setattr(MlflowClient, "log_artifact", refuse)
    started = time.monotonic()
    result = recipe.train(compose_cfg([*tiny_overrides(tmp_path), "tracking.outage_grace_s=600"]),
                          launch_dir=str(tmp_path))
    assert time.monotonic() - started < 120  # no 600 s of retries
    run = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED" and result.steps == 2
    assert (tmp_path / "run" / "summary.json").exists() and (tmp_path / "run" / "model").is_dir()
    assert not (tmp_path / "run" / "model-interrupted").exists()
    assert "only MLflow's copy of them is missing" in caplog.text


def test_a_run_gone_from_the_store_fails_the_writer_at_once_not_after_the_grace_period():
    from mlflow.entities import Metric
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST

    from grpo_pipeline.tracking.metric_writer import MetricWriter

    class Gone:
        def log_batch(self, run_id, metrics):
            raise MlflowException(f"Run with id={run_id} not found", error_code=RESOURCE_DOES_NOT_EXIST)

    writer = MetricWriter(Gone(), "abc123", every_s=0.05, grace_s=600)
    writer.add([Metric("reward", 0.5, 0, 1)])
    assert writer.flush(timeout=10) is False
    assert writer.failed and "run abc123" in writer.failed and "not found" in writer.failed
    assert len(writer.close(timeout=1)) == 1  # kept, for metrics_unsent.jsonl
