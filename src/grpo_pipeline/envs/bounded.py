"""Run functions on a bounded number of daemon threads, abandoning any that outlive a timeout.

Python cannot kill a thread: an abandoned one runs on in the background and its result is ignored;
`on_timeout` lets the caller cut it off from shared resources at that moment.
"""

import threading
import time
from collections.abc import Callable
from typing import Any


class Episode:
    def __init__(self, fn: Callable[["Episode"], Any]):
        self.fn = fn
        self.value: Any = None
        self.error: BaseException | None = None
        self.started = 0.0
        self.seconds = 0.0
        self.done = False
        self.timed_out = False
        self.waiting_for_lock = False  # a non-thread-safe env's episode, waiting for the one before it
        self.timed_out_waiting = False

    def run(self, changed: threading.Event) -> None:
        try:
            self.value = self.fn(self)
        except BaseException as e:  # reported to the caller with its traceback
            self.error = e
        finally:
            self.seconds = self.seconds or time.monotonic() - self.started
            self.done = True
            changed.set()


def run_bounded(fns: list[Callable[[Episode], Any]], max_workers: int, timeout_s: float,
                on_start: Callable[[int], None] = lambda i: None,
                on_timeout: Callable[[int], None] = lambda i: None, changed: threading.Event | None = None
                ) -> list[Episode]:
    """Run fns on at most max_workers daemon threads; an fn running longer than timeout_s is abandoned.
    `on_start(i)` is called for every fn of a wave before any of its threads starts; `on_timeout(i)` at
    the moment fn i is abandoned. `changed`: what the calling thread waits on between its checks (set when an fn
    ends), e.g. one that does the episodes' work meanwhile (batching.py `ServingEvent`): its wait may return late,
    so an fn found ended past its timeout counts as abandoned too."""
    episodes = [Episode(fn) for fn in fns]
    waiting = list(reversed(range(len(episodes))))
    running: set[int] = set()
    changed = changed if changed is not None else threading.Event()
    while waiting or running:
        changed.clear()  # before the scan below: a completion after it still wakes the wait
        wave = [waiting.pop() for _ in range(min(len(waiting), max(1, max_workers) - len(running)))]
        for i in wave:
            on_start(i)
        for i in wave:
            episodes[i].started = time.monotonic()
            threading.Thread(target=episodes[i].run, args=(changed,), daemon=True).start()
            running.add(i)
        now = time.monotonic()
        for i in list(running):
            ep = episodes[i]
            if ep.done and ep.seconds < timeout_s:
                running.discard(i)
            elif ep.done or now - ep.started >= timeout_s:  # (ended past its timeout: `changed` was busy, see above)
                ep.timed_out, ep.timed_out_waiting = True, ep.waiting_for_lock
                ep.seconds = ep.seconds if ep.done else now - ep.started
                running.discard(i)
                on_timeout(i)
        if running:
            next_deadline = min(episodes[i].started + timeout_s for i in running)
            changed.wait(timeout=max(0.0, next_deadline - time.monotonic()))
    return episodes
