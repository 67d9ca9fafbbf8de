"""MLflow tracking: one run per Hydra job.

We talk to MLflow through an explicit `MlflowClient` (no fluent API, no global active run), so two
trainings in one process never share state. The default store is SQLite under `outputs/` (MLflow 3
refuses a plain file store); artifacts go to `outputs/mlartifacts`. Open the UI with:

    mlflow ui --backend-store-uri sqlite:///outputs/mlflow.db

and go to the links a run prints at its end (`ui_links`): the experiment's runs view (with the reward and
held-out gain as columns) and the run's page.

Metrics go through a background `MetricWriter` (retries, grace period). With checkpoints on, a step's
metrics reach MLflow once a checkpoint covers it; TRL's `trainer_state.json` in each checkpoint holds the
metrics of every step up to it, and `resume` writes any of those MLflow lacks, so a kill at any moment
loses nothing and duplicates nothing. Everything written here passes through `mask_secrets`.
"""

import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpo_pipeline.config.schema import TrackingConfig
from grpo_pipeline.errors import ConfigError, PipelineError
from grpo_pipeline.tracking.metric_writer import permanent
from grpo_pipeline.tracking.redact import mask_secrets

log = logging.getLogger(__name__)
_MAX_PARAM_LEN = 500
_MAX_TAG_LEN = 5000
# MLflow 3 opens new experiments in its GenAI view unless told they hold model training runs.
_EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves a local store by default
# The runs view's columns, as a view the UI loads from an experiment tag (MLflow 3.17's shared views:
# `?viewStateShareKey=<key>` reads `mlflow.sharedViewState.<key>`): the reward and the held-out gain at a glance.
VIEW_KEY = "grpo_pipeline"
_RUNS_VIEW = (f"mlflow.sharedViewState.{VIEW_KEY}", json.dumps({
    "selectedColumns": [f"metrics.`{m}`" for m in ("reward", "eval_after/mean_reward", "eval_after/gain",
                                                   "eval_after/gain_se", "eval_val/mean_reward",
                                                   "eval_val/kl_to_base")],
    "orderByKey": "attributes.start_time", "orderByAsc": False}))


class TrackingError(PipelineError):
    """The tracking store stayed unreachable past tracking.outage_grace_s."""


def ui_links(uri: str, experiment_id: str, run_id: str) -> dict[str, str | None]:
    """The MLflow UI's pages of a run: its experiment's runs view and the run itself (MLflow 3.17's routes
    `#/experiments/<id>/runs[/<run id>]`; the experiment's own URL opens its GenAI overview, which lists no runs),
    and the command that serves the UI for a local store (None: the tracking server serves it)."""
    from urllib.parse import urlsplit, urlunsplit

    served = uri.startswith(("http://", "https://"))
    if served:
        parts = urlsplit(uri)
        base = urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))  # no credentials
    else:
        base = LOCAL_UI
    runs = f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs"
    return {"experiment_runs": f"{runs}?viewStateShareKey={VIEW_KEY}", "run": f"{runs}/{run_id}",
            "serve": None if served else f"mlflow ui --backend-store-uri {mask_secrets(uri)}"}


def default_tracking_uri(launch_dir: str | Path) -> str:
    return f"sqlite:///{Path(launch_dir).resolve() / 'outputs' / 'mlflow.db'}"


def metric_history(tracking_uri: str, run_id: str, key: str) -> list[float]:
    """One metric of a run, in step order (for benchmarks and reports)."""
    from mlflow.tracking import MlflowClient

    history = MlflowClient(tracking_uri).get_metric_history(run_id, key)
    return [m.value for m in sorted(history, key=lambda m: m.step)]


def flatten(node: Any, prefix: str = "") -> dict[str, str]:
    """{'loss': {'kl_coef': 0.1}} -> {'loss.kl_coef': '0.1'}: the params of a run."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): mask_secrets(str(node))[:_MAX_PARAM_LEN]}


def retry(call: Callable, grace_s: float, what: str):
    """Run `call`, retrying with backoff for up to grace_s seconds (the store may be restarting or locked).
    A permanent error (see `permanent`) is raised at once as a TrackingError: waiting cannot help."""
    started, attempt = time.monotonic(), 0
    while True:
        try:
            return call()
        except Exception as e:
            if permanent(e):
                raise TrackingError(f"MLflow: {what} failed: {first_line(e, 300)} (not retried: the store gives "
                                    "this error again however long one waits)") from e
            attempt += 1
            if time.monotonic() - started > grace_s:
                raise TrackingError(f"MLflow: {what} failed for {grace_s:g}s (tracking.outage_grace_s): "
                                    f"{first_line(e, 300)}") from e
            if attempt == 1:
                log.warning("MLflow: %s failed (%s); retrying for up to %gs.", what, first_line(e, 200), grace_s)
            time.sleep(min(10.0, 0.5 * 2 ** (attempt - 1)))


class Tracker:
    """One MLflow run. With tracking disabled every method is a no-op."""

    def __init__(self, cfg: TrackingConfig, launch_dir: str | Path, enabled: bool = True, uri: str | None = None):
        self.enabled = cfg.enabled and enabled
        self.cfg = cfg
        self.run_id: str | None = None
        self.uri: str | None = None
        self.nonfinite: dict[str, int] = {}  # metric -> how many of its values were NaN/inf
        self.writer = None
        self._gave_up: str | None = None
        if not self.enabled:
            return
        from mlflow.tracking import MlflowClient

        self.uri = cfg.tracking_uri or uri or default_tracking_uri(launch_dir)
        # Fail in seconds, not after minutes of retries, when a tracking server is unreachable at start.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # we retry ourselves (MetricWriter, retry)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
        artifacts = None
        try:
            if self.uri.startswith("sqlite:///"):  # a local store: artifacts go next to the database
                db_dir = Path(self.uri.removeprefix("sqlite:///")).resolve().parent
                db_dir.mkdir(parents=True, exist_ok=True)
                artifacts = (db_dir / "mlartifacts").as_uri()
            self.client = MlflowClient(tracking_uri=self.uri)
            experiment = self.client.get_experiment_by_name(cfg.experiment_name)
            if experiment is None:
                self.experiment_id = self.client.create_experiment(
                    cfg.experiment_name, artifact_location=artifacts, tags=dict([_EXPERIMENT_KIND, _RUNS_VIEW]))
            else:
                self.experiment_id = experiment.experiment_id
                for key, value in (_EXPERIMENT_KIND, _RUNS_VIEW):
                    if key not in experiment.tags:
                        self.client.set_experiment_tag(self.experiment_id, key, value)
        except Exception as e:
            raise ConfigError(
                f"tracking.tracking_uri='{mask_secrets(self.uri)}' is not usable ({e.__class__.__name__}: "
                f"{mask_secrets(str(e)[:300])}). Fix the URI (e.g. sqlite:///outputs/mlflow.db or "
                "http://host:5000), or set tracking.enabled=false."
            ) from e

    def ui_links(self) -> dict[str, str | None] | None:
        return ui_links(self.uri, self.experiment_id, self.run_id) if self.run_id else None

    # --- the run ----------------------------------------------------------------------------------
    def start(self, run_name: str, params: dict[str, str], tags: dict[str, str], description: str = "") -> None:
        if not self.enabled:
            return
        from mlflow.entities import Param

        tags = {k: mask_secrets(str(v))[:_MAX_TAG_LEN] for k, v in tags.items()}
        if description:
            tags["mlflow.note.content"] = mask_secrets(description)
        run = self.client.create_run(self.experiment_id, run_name=mask_secrets(run_name)[:250], tags=tags)
        self.run_id = run.info.run_id
        items = [Param(k, mask_secrets(v)) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])
        self._start_writer()

    def resume(self, run_id: str, checkpoint: Path | None = None) -> None:
        """Continue an earlier run after a crash: write the metrics of every step up to the checkpoint that
        MLflow lacks (a kill can come between a checkpoint and the write), then go on from its step."""
        if not self.enabled:
            return
        self.run_id = run_id
        try:
            retry(lambda: self.client.update_run(run_id, status="RUNNING"), self.cfg.outage_grace_s,
                  "reopening the run")
        except TrackingError as e:
            self.run_id = None
            if "RESOURCE_DOES_NOT_EXIST" not in str(e) and "not found" not in str(e).lower():
                raise
            raise TrackingError(f"Resume: the run's MLflow run {run_id} (run_id.txt) is not in "
                                f"{mask_secrets(self.uri)}. Resume with the store the run started in "
                                "(tracking.tracking_uri=...; run.json records it), or start a new run.") from e
        if checkpoint is not None:
            self._repair(checkpoint)
        self._start_writer()

    def hold_uncheckpointed(self, hold: bool) -> None:
        """With checkpoints on, keep each step's metrics back until a checkpoint covers it."""
        if self.writer is not None and hold:
            self.writer.hold_after(0)

    def checkpointed(self, step: int) -> None:
        if self.writer is not None:
            self.writer.release(step)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.writer is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        for key, value in metrics.items():  # counted, not dropped: MLflow would show only a gap
            if not math.isfinite(value):
                self.nonfinite[key] = self.nonfinite.get(key, 0) + 1
        counts = {f"nonfinite/{k}": float(n) for k, n in self.nonfinite.items()}
        self.writer.add([Metric(_metric_key(k), v, now, step) for k, v in (metrics | counts).items()
                         if math.isfinite(v)])

    def log_now(self, metrics: dict[str, float], step: int) -> None:
        """Write at once, whatever is held back (for evaluations that a resumed run never repeats)."""
        if self.run_id is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(_metric_key(k), v, now, step) for k, v in metrics.items() if math.isfinite(v)]
        retry(lambda: self.client.log_batch(self.run_id, metrics=batch), self._grace, "logging metrics")

    @property
    def failed(self) -> str | None:
        """Why tracking has given up (store down past the grace period), else None."""
        if self.writer is not None and self.writer.failed:
            self._gave_up = self.writer.failed
        return self._gave_up

    @property
    def _grace(self) -> float:
        return 5.0 if self.failed else self.cfg.outage_grace_s  # once given up, don't wait again

    def set_tag(self, key: str, value: str) -> None:
        if self.run_id:
            retry(lambda: self.client.set_tag(self.run_id, key, mask_secrets(str(value))[:_MAX_TAG_LEN]),
                  self._grace, f"setting tag {key}")

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if self.run_id and os.path.exists(path):
            retry(lambda: self.client.log_artifact(self.run_id, str(path), artifact_path),
                  self._grace, f"logging artifact {Path(path).name}")

    def log_table(self, data: dict, artifact_file: str) -> None:
        if self.run_id:
            retry(lambda: self.client.log_table(self.run_id, data, artifact_file), self._grace,
                  f"logging table {artifact_file}")

    def end(self, status: str = "FINISHED", unsent_path: Path | None = None) -> None:
        """Write the queued metrics (waiting up to the grace period), then close the run. A run that did not
        finish keeps its uncheckpointed steps out of MLflow (a resume replays them) and in `unsent_path`."""
        if not self.run_id:
            return
        grace = self._grace
        writer, self.writer = self.writer, None
        if writer is not None:
            if status == "FINISHED":
                writer.release(math.inf)
            unsent = writer.close(timeout=grace)
            if unsent:
                self._keep_unsent(unsent, unsent_path, writer.last_error, replayed=status != "FINISHED")
        try:
            retry(lambda: self.client.set_terminated(self.run_id, status), grace,
                  f"marking the run {status}")
        except TrackingError as e:
            log.error("%s", e)

    # --- internals --------------------------------------------------------------------------------
    def _start_writer(self) -> None:
        from grpo_pipeline.tracking.metric_writer import MetricWriter

        self.writer = MetricWriter(self.client, self.run_id, self.cfg.flush_every_s, self.cfg.outage_grace_s)

    def _repair(self, checkpoint: Path) -> None:
        from mlflow.entities import Metric

        state = json.loads((checkpoint / "trainer_state.json").read_text())
        history, step = state["log_history"], state["global_step"]
        present: dict[str, set[int]] = {}
        missing = []
        now = int(time.time() * 1000)
        for entry in history:
            for key, value in numeric(entry).items():
                if key == "step" or not math.isfinite(value):
                    continue
                key = _metric_key(key)
                if key not in present:
                    present[key] = {m.step for m in retry(lambda k=key: self.client.get_metric_history(self.run_id, k),
                                                          self.cfg.outage_grace_s, "reading metric history")}
                if entry.get("step", 0) not in present[key]:
                    missing.append(Metric(key, value, now, entry.get("step", 0)))
        for i in range(0, len(missing), 1000):
            chunk = missing[i : i + 1000]
            retry(lambda c=chunk: self.client.log_batch(self.run_id, metrics=c), self.cfg.outage_grace_s,
                  "writing the checkpoint's metrics")
        if missing:
            log.warning("Resume: wrote %d metric values of steps <= %d that the kill kept from MLflow.",
                        len(missing), step)
        later = sorted({s for steps in present.values() for s in steps if s > step})
        if later:
            log.warning("Resume: MLflow already has steps %s..%s after checkpoint step %d (written by an earlier "
                        "version or by hand); the resumed run logs those steps again.", later[0], later[-1], step)

    def _keep_unsent(self, unsent: list, path: Path | None, error: str | None, replayed: bool = False) -> None:
        where = "nowhere (no run dir)"
        if path is not None:
            with open(path, "a") as f:
                for m in unsent:
                    f.write(json.dumps({"key": m.key, "value": m.value, "step": m.step, "timestamp": m.timestamp}) + "\n")
            where = str(path)
        if replayed:  # held back: past the last checkpoint, which a resume starts from
            log.warning("MLflow: %d metric values of steps after the last checkpoint were not written (a resume "
                        "runs those steps again); they are kept in %s.", len(unsent), where)
        else:
            log.error("MLflow: %d metric values could not be written (%s); they are kept in %s.",
                      len(unsent), error or "store unreachable", where)


def _metric_key(key: str) -> str:
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in key)[:250]  # MLflow's limit


def first_line(error: BaseException, limit: int) -> str:
    """`ErrorClass: first line of the message`, credentials masked (the message may be empty)."""
    line = (str(error).splitlines() or [""])[0]
    return mask_secrets(f"{error.__class__.__name__}: {line}"[:limit])


def numeric(logs: dict) -> dict[str, float]:
    return {k: float(v) for k, v in logs.items() if isinstance(v, int | float) and not isinstance(v, bool)}
