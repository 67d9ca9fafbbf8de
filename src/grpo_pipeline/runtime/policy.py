"""The model as an env sees it: one revocable handle on the live policy per episode.

TRL trains the very weights the env's `score_episode` calls, right after the reward function returns.
So every model call an env makes goes through its episode's `PolicyHandle`, which
- runs it without gradients (the runtime puts the model in eval mode for the batch) and fills the run's
  sampling settings (`do_sample`, `temperature`, ...) into `generate` calls that do not set them;
- counts it as in flight, so the batch waits for it before the trainer touches the weights again;
- refuses it once the runtime has let go of the episode (timed out, or its batch scored): any later
  `generate`, `__call__`, `forward` or attribute access raises `EpisodeAbandoned` in the env's thread.
"""

import logging
import threading
from contextlib import contextmanager

import torch

from grpo_pipeline.runtime.batching import GenerateBatcher

log = logging.getLogger(__name__)

class EpisodeAbandoned(RuntimeError):
    """An episode used the model after the runtime let go of it (timeout, or its batch was scored)."""


class InFlight:
    """The model calls running now through one batch's handles."""

    def __init__(self):
        self.cond = threading.Condition()
        self.count = 0

    def wait_idle(self, warn_every_s: float = 60.0) -> None:
        """Block until no call is running: the trainer must not update weights under a generate."""
        with self.cond:
            while self.count:
                if not self.cond.wait(timeout=warn_every_s):
                    log.warning("Waiting for %d model call(s) of env episodes to finish before training goes on.",
                                self.count)


class PolicyHandle:
    def __init__(self, model, in_flight: InFlight, label: str, batcher: GenerateBatcher | None = None,
                 sampling: dict | None = None):
        self._model = model
        self._in_flight = in_flight
        self._label = label  # e.g. "episode 3 (row {...})": names the episode in errors
        self._batcher = batcher
        self._sampling = dict(sampling or {})
        self._revoked: str | None = None
        self._in_batcher = False

    # --- what the env calls ----------------------------------------------------------------------
    def generate(self, *args, **kwargs):
        kwargs = self._with_sampling(kwargs)
        with self._call():
            if self._batcher is not None:
                return self._batcher.submit(self._label, args, kwargs)
            return self._model.generate(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        with self._call():
            return self._model(*args, **kwargs)

    def forward(self, *args, **kwargs):
        with self._call():
            return self._model.forward(*args, **kwargs)

    def __getattr__(self, name):
        if name in _FIELDS or (name.startswith("__") and name.endswith("__")):  # during construction or copying
            raise AttributeError(name)
        self._check()
        return getattr(self._model, name)

    # --- the runtime's side ----------------------------------------------------------------------
    def join_batcher(self) -> None:
        """The batcher waits for this episode's calls before running a merged generate."""
        if self._batcher is None:
            return
        with self._in_flight.cond:
            joining = self._in_batcher = self._revoked is None
        if joining:
            self._batcher.episode_started()

    def leave_batcher(self) -> None:
        """The batcher stops waiting for this episode's calls (once, whoever calls it first)."""
        with self._in_flight.cond:
            leaving, self._in_batcher = self._in_batcher, False
        if leaving:
            self._batcher.episode_ended()

    def revoke(self, reason: str) -> None:
        with self._in_flight.cond:
            self._revoked = self._revoked or reason
        if self._batcher is not None:
            self._batcher.cancel(self._label, EpisodeAbandoned(self._revoked))
        self.leave_batcher()

    @property
    def revoked(self) -> bool:
        return self._revoked is not None

    # --- internals -------------------------------------------------------------------------------
    def _check(self) -> None:
        if self._revoked is not None:
            raise EpisodeAbandoned(self._revoked)

    @contextmanager
    def _call(self):
        """Check the handle, count the call as in flight and turn gradients off, for one model call."""
        with self._in_flight.cond:  # check and count at once: a revoke either sees this call or refuses it
            self._check()
            self._in_flight.count += 1
        try:
            with torch.no_grad():
                yield
        finally:
            with self._in_flight.cond:
                self._in_flight.count -= 1
                self._in_flight.cond.notify_all()

    def _with_sampling(self, kwargs: dict) -> dict:
        if kwargs.get("do_sample") is False or "generation_config" in kwargs:  # the env chose its own sampling
            return kwargs
        return {k: v for k, v in self._sampling.items() if k not in kwargs} | kwargs


_FIELDS = {"_model", "_in_flight", "_label", "_batcher", "_sampling", "_revoked", "_in_batcher"}

