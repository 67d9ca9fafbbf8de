"""Ships metrics to MLflow from a background thread: retries, a held-back tail, and a grace period.

- Training never waits on the store: `add` queues, a daemon thread writes every `every_s` seconds in
  `log_batch` calls of at most 1000 metrics (one transaction each in MLflow's SQL store).
- A failed write (server restart, sqlite lock) is retried with exponential backoff; the metrics stay
  queued and a warning is printed once. When the store has been failing for `grace_s` seconds, `failed`
  is set and the recipe stops the run with a checkpoint (see callbacks.RunLogger).
- `hold_after(step)`: metrics of later steps are kept back until `release(step)`. With checkpoints on,
  only steps covered by a checkpoint reach MLflow, so a run resumed after a kill replays nothing that
  MLflow already has: every step is in its history exactly once (see Tracker.resume for the repair of
  steps a kill kept from being written).

Not MLflow's `log_metrics(..., synchronous=False)`: its futures are not retried, so an outage loses the metrics,
and it cannot hold back steps that no checkpoint covers (docs/layout.md, "Library or hand-written").
"""

import errno
import logging
import math
import threading
import time

from grpo_pipeline.tracking.redact import mask_secrets

log = logging.getLogger(__name__)
MAX_BATCH = 1000  # MLflow's limit of metrics per log_batch


# MLflow error codes that the store gives again however long one waits (not an outage)
PERMANENT_CODES = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "PERMISSION_DENIED", "INVALID_STATE",
                   "RESOURCE_ALREADY_EXISTS")


def permanent(error: BaseException) -> bool:
    """A store error that retrying cannot fix: a run id the store lacks, refused values, an artifact store this
    process may not write (permission denied, read-only file system). Outages (refused connections, timeouts,
    5xx, a locked sqlite file) are not permanent."""
    if getattr(error, "error_code", None) in PERMANENT_CODES:
        return True
    return isinstance(error, OSError) and error.errno in (errno.EACCES, errno.EPERM, errno.EROFS)


class MetricWriter:
    def __init__(self, client, run_id: str, every_s: float, grace_s: float):
        self.client, self.run_id = client, run_id
        self.every_s, self.grace_s = every_s, grace_s
        self._cond = threading.Condition()
        self._pending: list = []
        self._released = math.inf  # metrics with step <= this may be written
        self._flush_wanted = False
        self._closed = False
        self._busy = False
        self.down_since: float | None = None
        self.last_error: str | None = None
        self.failed: str | None = None  # set once the store has been failing for longer than grace_s
        self._thread = threading.Thread(target=self._loop, name="mlflow-metrics", daemon=True)
        self._thread.start()

    # --- the training thread's side ----------------------------------------------------------------
    def add(self, metrics: list) -> None:
        with self._cond:
            self._pending += metrics

    def hold_after(self, step: float) -> None:
        with self._cond:
            self._released = step

    def release(self, step: float) -> None:
        """Metrics up to `step` may be written (a checkpoint covering them exists)."""
        with self._cond:
            self._released = max(self._released, step)
            self._flush_wanted = True
            self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Write everything released now; True when it all reached the store within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._flush_wanted = True
            self._cond.notify_all()
            while self._busy or self._writable():
                if self.failed or time.monotonic() >= deadline:
                    return False
                self._cond.wait(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
        return True

    def close(self, timeout: float) -> list:
        """Flush what is released, stop the thread and return what was not written (held back or failed)."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
        with self._cond:
            return list(self._pending)

    # --- the writer thread -------------------------------------------------------------------------
    def _writable(self) -> list:
        return [m for m in self._pending if m.step <= self._released]

    def _loop(self) -> None:
        attempt = 0
        while True:
            with self._cond:
                if attempt == 0:  # wait for the next write time, a flush, or close
                    self._cond.wait_for(lambda: self._closed or self._flush_wanted, timeout=self.every_s)
                else:  # back off after a failed write
                    self._cond.wait_for(lambda: self._closed, timeout=min(30.0, 0.5 * 2 ** (attempt - 1)))
                if self._closed:
                    return
                batch = self._writable()[:MAX_BATCH]
                self._flush_wanted = self._flush_wanted and len(self._writable()) > len(batch)
                self._busy = bool(batch)
            if not batch:
                continue
            try:
                self.client.log_batch(self.run_id, metrics=batch)
            except Exception as e:  # retried: the store may be restarting or locked
                if _refused(e):  # the store refuses these values: retrying cannot help
                    log.error("MLflow refused %d metric values (%s); they are dropped.", len(batch), _line(e))
                    self._note_success(batch)
                    continue
                if permanent(e):  # e.g. the run is gone from the store: stop now, not after the grace period
                    self.last_error = _line(e)
                    self.failed = f"the MLflow store refuses every write to run {self.run_id} ({self.last_error})"
                    attempt += 1
                    continue
                attempt += 1
                self._note_failure(e)
            else:
                attempt = 0
                self._note_success(batch)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _note_failure(self, error: Exception) -> None:
        now = time.monotonic()
        self.last_error = _line(error)
        if self.down_since is None:
            self.down_since = now
            log.warning("Writing metrics to MLflow failed (%s). Training goes on; the metrics are kept and "
                        "retried, for up to tracking.outage_grace_s=%gs.", self.last_error, self.grace_s)
        elif now - self.down_since > self.grace_s and not self.failed:
            self.failed = (f"the MLflow store has failed every write for {now - self.down_since:.0f}s, longer than "
                           f"tracking.outage_grace_s={self.grace_s:g} (last error: {self.last_error})")

    def _note_success(self, batch: list) -> None:
        with self._cond:
            written = {id(m) for m in batch}
            self._pending = [m for m in self._pending if id(m) not in written]
        if self.down_since is not None:
            log.warning("MLflow is reachable again after %.0fs; the kept metrics are being written.",
                        time.monotonic() - self.down_since)
            self.down_since = None


def _line(error: BaseException) -> str:
    line = (str(error).splitlines() or [""])[0]
    return mask_secrets(f"{error.__class__.__name__}: {line}"[:300])


def _refused(error: BaseException) -> bool:
    """An error the store will give again for the same values (not an outage)."""
    return getattr(error, "error_code", None) in ("INVALID_PARAMETER_VALUE", "RESOURCE_ALREADY_EXISTS")
