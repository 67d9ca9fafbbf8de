"""The model as an env sees it: one revocable handle on the live policy per episode.

TRL trains the very weights the env's `score_episode` calls, right after the reward function returns.
So every model call an env makes goes through its episode's `PolicyHandle`, which
- runs it without gradients (the runtime puts the model in eval mode for the batch) and fills the run's
  sampling settings (`do_sample`, `temperature`, ...) into `generate` calls that do not set them;
- counts it as in flight, so the batch waits for it before the trainer touches the weights again;
- refuses it once the runtime has let go of the episode (timed out, or its batch scored): any later
  `generate`, `__call__`, `forward` or attribute access raises `EpisodeAbandoned` in the env's thread;
- in training, with a `CallRecorder` (recorder.py), keeps what each `generate` call sampled, so that the trainer
  trains those turns too (runtime.train_env_calls).
"""

import logging
import math
import threading
import time
from contextlib import contextmanager

import torch

from grpo_pipeline.envs.batching import GenerateBatcher
from grpo_pipeline.errors import EnvError

log = logging.getLogger(__name__)

class EpisodeAbandoned(RuntimeError):
    """An episode used the model after the runtime let go of it (timeout, or its batch was scored)."""


class InFlight:
    """The model calls running now through one batch's handles."""

    def __init__(self):
        self.cond = threading.Condition()
        self.count = 0
        self.running: dict[str, int] = {}  # label -> calls of that episode running now

    def wait_idle(self, deadline_s: float = math.inf, warn_every_s: float = 60.0) -> None:
        """Block until no call is running: the trainer must not update weights under a generate. Past
        `deadline_s` (runtime.call_deadline_s) an EnvError names the calls: the run stops rather than hang."""
        started = time.monotonic()
        with self.cond:
            while self.count:
                left = deadline_s - (time.monotonic() - started)
                if left <= 0:
                    raise EnvError(
                        f"{self.count} model call(s) of env episodes ({', '.join(sorted(self.running))}) still ran "
                        f"{deadline_s:g}s (runtime.call_deadline_s) after their batch ended; training cannot update "
                        "the weights under them, so the run stops. Make the env's model calls shorter (runtime."
                        "max_call_tokens caps max_new_tokens) or raise runtime.call_deadline_s.")
                if not self.cond.wait(timeout=min(warn_every_s, left)) and self.count and left > warn_every_s:
                    log.warning("Waiting for %d model call(s) of env episodes to finish before training goes on.",
                                self.count)


class PolicyHandle:
    def __init__(self, model, in_flight: InFlight, label: str, batcher: GenerateBatcher | None = None,
                 sampling: dict | None = None, max_call_tokens: int | None = None, recorder=None):
        self._model = model
        self._recorder = recorder
        self._max_call_tokens = max_call_tokens
        self._in_flight = in_flight
        self._label = label  # e.g. "episode 3 (row {...})": names the episode in errors
        self._batcher = batcher
        self._sampling = dict(sampling or {})
        self._revoked: str | None = None
        self._in_batcher = False

    # --- what the env calls ----------------------------------------------------------------------
    def generate(self, *args, **kwargs):
        kwargs = self._capped(self._with_sampling(kwargs), args)
        recorder = self._recorder
        if recorder is not None and not recorder.accepts(args, kwargs, self._model):
            recorder = None
        with self._call():
            if self._batcher is not None:
                return self._batcher.submit(self._label, args, kwargs, recorder)
            if recorder is not None:
                return recorder.generate(self._model, args, kwargs)
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
        flight = self._in_flight
        with flight.cond:  # check and count at once: a revoke either sees this call or refuses it
            self._check()
            flight.count += 1
            flight.running[self._label] = flight.running.get(self._label, 0) + 1
        try:
            with torch.no_grad():
                yield
        finally:
            with flight.cond:
                flight.count -= 1
                flight.running[self._label] -= 1
                if not flight.running[self._label]:
                    del flight.running[self._label]
                flight.cond.notify_all()

    def _capped(self, kwargs: dict, args: tuple) -> dict:
        """max_new_tokens cut to runtime.max_call_tokens, also when the model's max_length would allow more."""
        cap = self._max_call_tokens
        if cap is None or "generation_config" in kwargs:
            return kwargs
        asked = kwargs.get("max_new_tokens")
        if asked is None:
            ids = args[0] if args else kwargs.get("input_ids")
            max_length = kwargs.get("max_length") or getattr(getattr(self._model, "generation_config", None),
                                                             "max_length", None)
            width = ids.shape[-1] if isinstance(ids, torch.Tensor) else 0
            if max_length is None or max_length - width <= cap:
                return kwargs
            asked = max_length - width
        if asked <= cap:
            return kwargs
        if not _warned_cap:
            _warned_cap.append(asked)
            log.warning("An env's model.generate asked for %d new tokens; capped at runtime.max_call_tokens=%d "
                        "(raise it if the env needs longer calls).", asked, cap)
        return {k: v for k, v in kwargs.items() if k != "max_length"} | {"max_new_tokens": cap}

    def _with_sampling(self, kwargs: dict) -> dict:
        if kwargs.get("do_sample") is False or "generation_config" in kwargs:  # the env chose its own sampling
            return kwargs
        return {k: v for k, v in self._sampling.items() if k not in kwargs} | kwargs


_FIELDS = {"_model", "_in_flight", "_label", "_batcher", "_sampling", "_revoked", "_in_batcher", "_max_call_tokens",
           "_recorder"}
_warned_cap: list[int] = []  # the cap warning is given once per process

