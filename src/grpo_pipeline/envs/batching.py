"""Batch the `model.generate` calls of concurrently running episodes into one call.

Multi-turn envs call `model.generate` themselves, one episode at a time. While the runtime scores
a batch, each env thread's call is queued here; a single worker thread runs one `generate` for every
queued call with the same sampling arguments and a comparable `max_new_tokens` (at most 2x, or 32 tokens more,
than the shortest of the merge) once all live episodes are waiting (or the oldest call has waited `max_wait_s`,
so an episode busy with I/O does not hold the others back).

Each caller gets back exactly what its own call would return: its rows, its own left padding, and
generated tokens up to its own `max_new_tokens`, cut where all its rows have ended at its own eos (as
`generate` does for a single call). A call without `attention_mask` gets the mask `generate` would
infer (pad positions masked when pad != eos). When a merged call raises, each of its calls is re-run
alone, so one bad call (out-of-range ids, ...) fails only its own episode, with an error naming it.
Calls the batcher cannot merge (e.g. `return_dict_in_generate=True`, beam search, inputs other than
token ids) run on their own. After `close()` every call fails at once. A call with a `recorder` (training a
seed-style env's turns, recorder.py) has its rows' sampled tokens and log-probs recorded from the generate that ran it.
"""

import threading
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from grpo_pipeline.envs.recorder import sampled_logps

_MERGEABLE = {"max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
              "pad_token_id", "eos_token_id", "num_beams", "use_cache"}


class GenerateFailed(RuntimeError):
    """A queued generate call failed; the message names the episode that made it."""


class _Call:
    def __init__(self, owner: str | None, args: tuple, kwargs: dict, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor, gen_kwargs: dict, limit: int | None, eos_ids: torch.Tensor,
                 recorder=None):
        self.owner, self.args, self.kwargs = owner, args, kwargs  # the original call, for a solo re-run
        self.recorder = recorder  # a CallRecorder: keep what this call sampled (recorder.py)
        self.input_ids, self.attention_mask, self.gen_kwargs = input_ids, attention_mask, gen_kwargs
        self.limit, self.eos_ids = limit, eos_ids
        # calls merge when they sample alike; max_new_tokens may differ (each result is cut to its own). Without
        # any max_new_tokens, generate stops at a total max_length, so only calls of one prompt width merge.
        same = tuple(sorted((k, repr(v)) for k, v in gen_kwargs.items() if k != "max_new_tokens"))
        self.key = (same, input_ids.shape[1] if limit is None else None)
        self.created = time.monotonic()
        self.done = threading.Event()
        self.result: torch.Tensor | None = None
        self.error: BaseException | None = None


class GenerateBatcher:
    def __init__(self, model, pad_token_id: int, eos_token_id: int | list[int] | None, max_wait_s: float = 0.02,
                 fast=None, worker: bool = True):
        self.model = model
        # fast(sequences, max_new_tokens, sampling, eos_ids) -> (ids, log-probs) per sequence, or None: the runtime's
        # decode loop on its sampling copy (rollout/turns.py), used for calls whose samples are recorded
        self.fast = fast
        # fallbacks for a model without a generation_config; a real model's config and the call's kwargs win
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.max_wait_s = max_wait_s
        self.cond = threading.Condition()
        self.pending: list[_Call] = []
        self.active = 0  # episodes running now (the runtime keeps this up to date)
        self.calls = 0
        self.batches = 0
        self.running = True
        # who runs the merged calls: a thread of the batcher's own, or (worker=False) a thread that waits in `serve`,
        # e.g. the runtime's main thread while its episodes run (`ServingEvent`): on a thread other than the main one,
        # torch's OpenMP/MKL kernels ran SmolLM2's decode ~1.3x slower (AMD EPYC Zen 3, 2 cores; docs/results.md)
        self.worker: threading.Thread | None = None
        if worker:
            self.start_worker()

    def start_worker(self) -> None:
        """Run the calls on a thread of the batcher's own from now on (once no caller serves them: the calls that
        episodes abandoned after their batch may still make)."""
        with self.cond:
            if self.worker is None:
                self.worker = threading.Thread(target=self._loop, daemon=True)
                self.worker.start()

    # --- the runtime's side ----------------------------------------------------------------------
    def episode_started(self) -> None:
        with self.cond:
            self.active += 1

    def episode_ended(self) -> None:
        with self.cond:
            self.active -= 1
            self.cond.notify_all()

    def cancel(self, owner: str, error: BaseException) -> None:
        """Fail `owner`'s queued calls that have not started (its episode was abandoned)."""
        with self.cond:
            mine = [c for c in self.pending if c.owner == owner]
            self.pending = [c for c in self.pending if c.owner != owner]
        for call in mine:
            call.error = error
            call.done.set()

    def close(self) -> None:
        """Stop taking calls; queued and running ones finish first (however long a generate takes): on the worker,
        or without one on the calling thread."""
        with self.cond:
            self.running = False
            self.cond.notify_all()
        if self.worker is not None:
            self.worker.join()
        else:
            self._loop()

    # --- the env's side --------------------------------------------------------------------------
    def generate(self, *args, **kwargs):
        return self.submit(None, args, kwargs)

    def submit(self, owner: str | None, args: tuple, kwargs: dict, recorder=None):
        """`model.generate(*args, **kwargs)` for `owner` (e.g. "episode 3 (row ...)"), merged when possible;
        with `recorder`, what it sampled is recorded."""
        call = self._as_call(owner, args, kwargs, recorder)
        with self.cond:  # check and enqueue at once: the worker never exits with a call left behind
            if not self.running:
                raise RuntimeError(f"GenerateBatcher is closed (its batch was scored); the generate call of "
                                   f"{owner or 'a caller'} is refused.")
            if call is not None:
                self.pending.append(call)
                self.cond.notify_all()
        if call is None:
            with torch.no_grad():
                if recorder is not None:
                    return recorder.generate(self.model, args, kwargs)
                return self.model.generate(*args, **kwargs)
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.result

    def _as_call(self, owner, args, kwargs, recorder=None) -> _Call | None:
        gen_kwargs = dict(kwargs)
        input_ids = args[0] if args else gen_kwargs.pop("input_ids", gen_kwargs.pop("inputs", None))
        if len(args) > 1 or not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            return None
        if input_ids.dtype not in (torch.int, torch.long):
            return None
        mask = gen_kwargs.pop("attention_mask", None)
        if set(gen_kwargs) - _MERGEABLE or (gen_kwargs.get("num_beams") or 1) > 1:
            return None
        config = getattr(self.model, "generation_config", None)
        eos = _first_set(gen_kwargs.get("eos_token_id"), getattr(config, "eos_token_id", None),
                         None if config is not None else self.eos_token_id)
        eos_ids = torch.tensor(eos if isinstance(eos, list) else ([] if eos is None else [eos])).flatten()
        pad = _first_set(gen_kwargs.get("pad_token_id"), getattr(config, "pad_token_id", None),
                         None if config is not None else self.pad_token_id,
                         int(eos_ids[0]) if len(eos_ids) else None)  # generate pads with eos when pad is unset
        if mask is None:
            mask = _inferred_attention_mask(input_ids, pad, eos_ids)
        limit = _first_set(gen_kwargs.get("max_new_tokens"), getattr(config, "max_new_tokens", None))
        if limit is not None:
            gen_kwargs["max_new_tokens"] = limit
        return _Call(owner, args, kwargs, input_ids, mask, gen_kwargs, limit, eos_ids, recorder)

    # --- the worker ------------------------------------------------------------------------------
    def serve(self, until: Callable[[], bool], timeout: float | None = None, drain: bool = False) -> bool:
        """Run the queued calls on the calling thread, merged, as they become ready, until `until()` (read under the
        batcher's lock: whoever makes it true does so under `cond` and notifies it) or `timeout` seconds. With
        `drain`, the calls still queued once `until()` holds run first. Returns until()."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (batch := self._take(until, deadline, drain)) is not None:
            groups: dict[tuple, list[_Call]] = defaultdict(list)
            for call in batch:
                groups[call.key].append(call)
            for calls in groups.values():
                for comparable in _by_limit(calls):  # shortest first: a short call never waits on a long one
                    self._run(comparable)
        return until()

    def _take(self, until: Callable[[], bool], deadline: float | None, drain: bool) -> list[_Call] | None:
        """The calls to run next (all queued ones), or None to stop serving."""
        with self.cond:
            while True:
                stop = until()
                if stop and (not drain or not self.pending):
                    return None
                if self.pending and (stop or self._ready()):
                    batch, self.pending = self.pending, []
                    return batch
                now = time.monotonic()
                wait = self.pending[0].created + self.max_wait_s - now if self.pending else None
                if deadline is not None:
                    if deadline <= now:
                        return None
                    wait = deadline - now if wait is None else min(wait, deadline - now)
                self.cond.wait(timeout=None if wait is None else max(0.0, wait))

    def _loop(self) -> None:
        self.serve(lambda: not self.running, drain=True)

    def _ready(self) -> bool:
        if not self.pending:
            return False
        everyone_waiting = len(self.pending) >= self.active
        return everyone_waiting or time.monotonic() - self.pending[0].created >= self.max_wait_s

    def _run(self, calls: list[_Call]) -> None:
        try:
            if self.fast is not None:
                try:
                    if self._run_fast(calls):
                        return
                except Exception:  # the decode loop could not run them (nothing was recorded): generate does
                    pass

            if len(calls) == 1:
                self._run_alone(calls[0])
                return
            try:
                out, width, logps = self._generate_merged(calls)
            except Exception:  # one bad call must not fail the others: each runs on its own
                for call in calls:
                    self._run_alone(call)
                return
            self.calls += len(calls)
            self.batches += 1
            row = 0
            for call in calls:
                n = call.input_ids.shape[0]
                mine = out[row : row + n, width - call.input_ids.shape[1] :]
                if call.recorder is not None:
                    steps = logps.size(1) if call.limit is None else min(call.limit, logps.size(1))
                    call.recorder.add(call.input_ids, call.attention_mask, out[row : row + n, width:],
                                      logps[row : row + n, :steps], call.eos_ids.tolist())
                mine = _trim(mine, call.input_ids.shape[1], call.limit, call.eos_ids)
                call.result = mine.to(call.input_ids.device)
                row += n
        except BaseException as e:  # every waiting episode learns of it; none waits forever
            for call in calls:
                call.error = call.error or e
            if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit: the thread serving stops with it
                raise
        finally:
            for call in calls:
                call.done.set()

    def _generate_merged(self, calls: list[_Call]) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        """The calls as one generate: (output ids, the input width, and when a call records what it sampled, each
        generated token's log-prob under the calls' temperature ([rows, steps]), else None)."""
        width = max(c.input_ids.shape[1] for c in calls)
        pad = calls[0].gen_kwargs.get("pad_token_id") or 0  # any id: padded positions are masked
        ids = torch.cat([_left_pad(c.input_ids.cpu(), width, pad) for c in calls])
        mask = torch.cat([_left_pad(c.attention_mask.cpu(), width, 0) for c in calls])
        kwargs = dict(calls[0].gen_kwargs)
        if calls[0].limit is not None:
            kwargs["max_new_tokens"] = max(c.limit for c in calls)
        device = getattr(self.model, "device", ids.device)
        record = any(c.recorder is not None for c in calls)
        if record:
            kwargs |= {"output_logits": True, "return_dict_in_generate": True}
        with torch.no_grad():
            out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
        if record and hasattr(out, "sequences") and getattr(out, "logits", None):
            temperature = next(c.recorder for c in calls if c.recorder is not None).temperature  # the calls' own
            generated = out.sequences[:, width:]
            return out.sequences.cpu(), width, sampled_logps(out.logits, generated, temperature).cpu()
        if record:  # a model whose generate ignores output_logits: nothing to record
            for call in calls:
                if call.recorder is not None:
                    call.recorder.unrecordable()
                    call.recorder = None
            out = getattr(out, "sequences", out)
        return out.cpu(), width, None

    def _run_fast(self, calls: list[_Call]) -> bool:
        """Recorded calls through the runtime's decode loop on its sampling copy (one batch, each row unpadded; the
        copy is the one the step's first turns sampled from); False where it does not apply (a call not recorded,
        no max_new_tokens, other eos ids: generate runs them)."""
        if any(c.recorder is None or c.limit is None for c in calls):
            return False
        sequences = [c.recorder.rebased(c.input_ids[r][c.attention_mask[r].bool()].tolist())
                     for c in calls for r in range(c.input_ids.size(0))]  # the episode's own tokens where they fit
        sampling = {k: calls[0].gen_kwargs.get(k) for k in ("do_sample", "temperature", "top_k", "top_p")}
        result = self.fast(sequences, max(c.limit for c in calls), sampling, calls[0].eos_ids.tolist())
        if result is None:
            return False
        ids, logps = result
        laid_out, row = [], 0
        for call in calls:  # every call laid out first: a failure here records nothing, and generate runs them
            n = call.input_ids.size(0)
            mine = [i[: call.limit] for i in ids[row : row + n]]
            width = max(1, max(len(i) for i in mine))
            pad = call.gen_kwargs.get("pad_token_id")
            pad = pad if pad is not None else (int(call.eos_ids[0]) if len(call.eos_ids) else self.pad_token_id)
            generated = torch.full((n, width), pad, dtype=call.input_ids.dtype)
            values = torch.zeros((n, width))
            for r, (i, lp) in enumerate(zip(mine, logps[row : row + n], strict=True)):
                generated[r, : len(i)] = torch.tensor(i, dtype=call.input_ids.dtype)
                values[r, : len(i)] = torch.tensor(lp[: len(i)])
            laid_out.append((generated, values, sequences[row : row + n]))
            row += n
        for call, (generated, values, prompts) in zip(calls, laid_out, strict=True):
            call.recorder.add(call.input_ids, call.attention_mask, generated, values, call.eos_ids.tolist(), prompts)
            call.result = torch.cat([call.input_ids, generated.to(call.input_ids.device)], dim=1)
        self.calls += len(calls)
        self.batches += 1
        return True

    def _run_alone(self, call: _Call) -> None:
        try:
            with torch.no_grad():
                if call.recorder is not None:
                    call.result = call.recorder.generate(self.model, call.args, call.kwargs)
                else:
                    call.result = self.model.generate(*call.args, **call.kwargs)
            self.calls += 1
            self.batches += 1
        except Exception as e:
            shape, first_ids = tuple(call.input_ids.shape), call.input_ids[:, :8].tolist()
            call.error = GenerateFailed(
                f"model.generate failed for {call.owner or 'a queued call'} (input_ids {shape}, first ids "
                f"{first_ids}): {type(e).__name__}: {e}"
            )
            call.error.__cause__ = e


class ServingEvent:
    """A `threading.Event` for `run_bounded` (bounded.py) whose `wait` serves the batcher's calls on the waiting
    thread meanwhile: the thread that waits for the episodes runs their merged generate calls."""

    def __init__(self, batcher: GenerateBatcher):
        self._batcher, self._flag = batcher, False

    def set(self) -> None:
        with self._batcher.cond:
            self._flag = True
            self._batcher.cond.notify_all()

    def clear(self) -> None:
        with self._batcher.cond:
            self._flag = False

    def is_set(self) -> bool:
        return self._flag

    def wait(self, timeout: float | None = None) -> bool:
        return self._batcher.serve(lambda: self._flag, timeout)


SHORT_EXTRA = 32  # a call of limit n merges with calls of at most max(2n, n + SHORT_EXTRA) new tokens


def _by_limit(calls: list[_Call]) -> list[list[_Call]]:
    """Calls in groups of comparable max_new_tokens, shortest first: each group's longest limit is at most
    max(2x, +SHORT_EXTRA tokens) its shortest, so a 4-token call never waits behind a 2,000-token one (and
    times out). Calls without a limit share one prompt width (their key) and stay together."""
    groups: list[list[_Call]] = []
    for call in sorted(calls, key=lambda c: c.limit or 0):
        if groups and call.limit is not None and groups[-1][0].limit is not None:
            first = groups[-1][0].limit
            if call.limit <= max(2 * first, first + SHORT_EXTRA):
                groups[-1].append(call)
                continue
        elif groups and call.limit is None and groups[-1][0].limit is None:
            groups[-1].append(call)
            continue
        groups.append([call])
    return groups


def _first_set(*values):
    return next((v for v in values if v is not None), None)


def _inferred_attention_mask(input_ids: torch.Tensor, pad: int | None, eos_ids: torch.Tensor) -> torch.Tensor:
    """The mask `generate` infers without one (transformers' `_prepare_attention_mask_for_generation`):
    pad positions are masked when the pad id occurs in the input and is not an eos id; else all ones."""
    if pad is not None and bool((input_ids == pad).any()) and pad not in eos_ids.tolist():
        return input_ids.ne(pad).long()
    return torch.ones_like(input_ids, dtype=torch.long)


def _trim(out: torch.Tensor, prompt_len: int, limit: int | None, eos_ids: torch.Tensor) -> torch.Tensor:
    """Cut the generated part where all rows have produced eos (inclusive), and at `limit` tokens."""
    gen = out[:, prompt_len:]
    if limit is not None:
        gen = gen[:, :limit]
    if len(eos_ids) and gen.shape[1]:
        is_eos = torch.isin(gen, eos_ids.to(gen.device))
        if is_eos.any(dim=1).all():
            gen = gen[:, : int(is_eos.int().argmax(dim=1).max()) + 1]
    return torch.cat([out[:, :prompt_len], gen], dim=1)


def _left_pad(t: torch.Tensor, width: int, value: int) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    pad = torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype, device=t.device)
    return torch.cat([pad, t], dim=1)
