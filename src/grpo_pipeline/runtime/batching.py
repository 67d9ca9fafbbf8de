"""Batch the `model.generate` calls of concurrently running episodes into one call.

Multi-turn envs call `model.generate` themselves, one episode at a time. While the runtime scores
a batch, each env thread's call is queued here; a single worker thread runs one `generate` for every
queued call with the same sampling arguments once all live episodes are waiting (or the oldest call
has waited `max_wait_s`, so an episode busy with I/O does not hold the others back).

Each caller gets back exactly what its own call would return: its rows, its own left padding, and
generated tokens up to its own `max_new_tokens`, cut where all its rows have ended (as `generate`
does for a single call). Calls the batcher cannot merge (e.g. `return_dict_in_generate=True`, or
inputs other than token ids) run on their own.
"""

import threading
import time
from collections import defaultdict

import torch

_MERGEABLE = {"max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
              "pad_token_id", "eos_token_id", "num_beams", "use_cache"}


class _Call:
    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, kwargs: dict):
        self.input_ids, self.attention_mask, self.kwargs = input_ids, attention_mask, kwargs
        # calls merge when they sample alike; max_new_tokens may differ (each result is cut to its own)
        same = tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k != "max_new_tokens"))
        self.key = (same, "max_new_tokens" in kwargs)
        self.created = time.monotonic()
        self.done = threading.Event()
        self.result: torch.Tensor | None = None
        self.error: BaseException | None = None


class GenerateBatcher:
    def __init__(self, model, pad_token_id: int, eos_token_id: int | list[int] | None, max_wait_s: float = 0.02):
        self.model = model
        self.pad_token_id = pad_token_id
        eos = eos_token_id if eos_token_id is not None else []
        self.eos_ids = torch.tensor(eos if isinstance(eos, list) else [eos])
        self.max_wait_s = max_wait_s
        self.cond = threading.Condition()
        self.pending: list[_Call] = []
        self.active = 0  # episodes running now (the runtime keeps this up to date)
        self.calls = 0
        self.batches = 0
        self.running = True
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

    def close(self) -> None:
        with self.cond:
            self.running = False
            self.cond.notify_all()
        self.worker.join(timeout=5)

    # --- the env's side --------------------------------------------------------------------------
    def generate(self, *args, **kwargs):
        call = self._as_call(args, kwargs)
        if call is None or not self.running:
            with torch.no_grad():
                return self.model.generate(*args, **kwargs)
        with self.cond:
            self.pending.append(call)
            self.cond.notify_all()
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.result

    def _as_call(self, args, kwargs) -> _Call | None:
        kwargs = dict(kwargs)
        input_ids = args[0] if args else kwargs.pop("input_ids", kwargs.pop("inputs", None))
        if len(args) > 1 or not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            return None
        mask = kwargs.pop("attention_mask", None)
        if set(kwargs) - _MERGEABLE:
            return None
        if mask is None:
            mask = torch.ones_like(input_ids)
        return _Call(input_ids, mask, kwargs)

    # --- the worker ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.cond:
                while self.running and not self._ready():
                    timeout = None
                    if self.pending:
                        timeout = max(0.0, self.pending[0].created + self.max_wait_s - time.monotonic())
                    self.cond.wait(timeout=timeout)
                if not self.running and not self.pending:
                    return
                batch, self.pending = self.pending, []
            groups: dict[tuple, list[_Call]] = defaultdict(list)
            for call in batch:
                groups[call.key].append(call)
            for calls in groups.values():
                self._run(calls)

    def _ready(self) -> bool:
        if not self.pending:
            return False
        everyone_waiting = len(self.pending) >= self.active
        return everyone_waiting or time.monotonic() - self.pending[0].created >= self.max_wait_s

    def _run(self, calls: list[_Call]) -> None:
        try:
            width = max(c.input_ids.shape[1] for c in calls)
            ids = torch.cat([_left_pad(c.input_ids, width, self.pad_token_id) for c in calls])
            mask = torch.cat([_left_pad(c.attention_mask, width, 0) for c in calls])
            kwargs = dict(calls[0].kwargs)
            limits = [c.kwargs.get("max_new_tokens") for c in calls]
            if None not in limits:
                kwargs["max_new_tokens"] = max(limits)
            device = getattr(self.model, "device", ids.device)
            with torch.no_grad():
                out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs).cpu()
            self.calls += len(calls)
            self.batches += 1
            row = 0
            for call, limit in zip(calls, limits, strict=True):
                n = call.input_ids.shape[0]
                mine = out[row : row + n, width - call.input_ids.shape[1] :]
                call.result = self._trim(mine, call.input_ids.shape[1], limit).to(call.input_ids.device)
                row += n
        except BaseException as e:  # every waiting episode learns of it
            for call in calls:
                call.error = e
        finally:
            for call in calls:
                call.done.set()

    def _trim(self, out: torch.Tensor, prompt_len: int, limit: int | None) -> torch.Tensor:
        """Cut the generated part where all rows have produced eos (inclusive), and at `limit` tokens."""
        gen = out[:, prompt_len:]
        if limit is not None:
            gen = gen[:, :limit]
        if len(self.eos_ids) and gen.shape[1]:
            is_eos = torch.isin(gen, self.eos_ids)
            ended = is_eos.any(dim=1)
            if ended.all():
                gen = gen[:, : int(is_eos.int().argmax(dim=1).max()) + 1]
        return torch.cat([out[:, :prompt_len], gen], dim=1)


def _left_pad(t: torch.Tensor, width: int, value: int) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    pad = torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype, device=t.device)
    return torch.cat([pad, t], dim=1)
