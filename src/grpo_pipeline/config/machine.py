"""What this CPU does fast, from what it does rather than what oneDNN says it supports.

`runtime.generation_dtype: null` samples from a bfloat16 copy only where bf16 really is faster here. oneDNN's
`_is_mkldnn_bf16_supported()` is true on any AVX-512 CPU, also where bf16 is emulated: on an Intel Xeon with
AVX-512 but without AVX512-BF16/AMX the bf16 copy decoded 2.2x slower and made the default run's step 1.4x
slower (docs/results.md). So:
- a CPU whose flags (Linux /proc/cpuinfo) lack avx512_bf16 and amx_bf16 samples in float32, unmeasured;
- otherwise a ~0.3 s measurement times what a decode step spends its time on (the linear layers of a
  SmolLM2-sized stack, a few rows, float32 as the runtime runs it, prepacked for oneDNN where it packs, against
  bf16), and bf16 is chosen when it is at least `MIN_SPEEDUP` faster. The result is cached per machine (CPU
  name, flags, torch version, threads) in `$GRPO_PIPELINE_CACHE` (default ~/.cache/grpo_pipeline/machine.json).

`runtime.packed_generation: null` likewise: a float32 copy holds its weights prepacked for oneDNN only where a
~0.25 s measurement (the same layers, 8 and 32 rows, packed vs plain) finds packing at least `MIN_PACK_SPEEDUP`
faster. Whole rollouts gained 1.37-1.47x from packing on an AMD EPYC and 0.94-1.00x on an Intel Xeon with AMX, whose
layers alone still measure 1.22-1.34x faster packed: this measures the layers, not a whole decode step
(docs/results.md).
"""

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)
MIN_SPEEDUP = 1.15  # below this, a bf16 copy's extra refresh and behaviour-log-prob bookkeeping are not worth it
MIN_PACK_SPEEDUP = 1.10  # below this, repacking at every refresh and a second copy of the weights are not worth it
_SHAPE = (576, 1536, 6, 32)  # hidden, intermediate, layers, rows: SmolLM2-135M's MLP, the default run's rows


@dataclass(frozen=True)
class Choice:
    value: str
    why: str


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags (Linux), or None where they cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.partition(":")[2].split())
    return None


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_path() -> Path:
    return Path(os.environ.get("GRPO_PIPELINE_CACHE") or Path.home() / ".cache" / "grpo_pipeline") / "machine.json"


def sampling_dtype(packed: bool) -> Choice:
    """float32 or bfloat16 for sampling a float32 model on this CPU, and why."""
    flags = cpu_flags()
    if flags is not None and not flags & {"avx512_bf16", "amx_bf16"}:
        return Choice("float32", f"{cpu_name()} has no AVX512-BF16/AMX: bf16 would be emulated")
    timing = bf16_timing(packed)
    speedup = timing["float32_ms"] / timing["bfloat16_ms"]
    value = "bfloat16" if speedup >= MIN_SPEEDUP else "float32"
    return Choice(value, f"measured on {cpu_name()}: bf16 matmuls {speedup:.2f}x the speed of float32"
                         f"{' (prepacked)' if packed else ''} (bf16 needs {MIN_SPEEDUP}x; {cache_path()})")


def packing_choice() -> tuple[bool, str]:
    """Whether a float32 copy decodes faster with its weights prepacked for oneDNN here, and why."""
    timing = _cached(_machine_key(True) + "|pack-vs-plain", measure_packing)
    speedup = timing["plain_ms"] / timing["packed_ms"]
    return speedup >= MIN_PACK_SPEEDUP, (f"null: measured on {cpu_name()}: prepacked float32 matmuls {speedup:.2f}x "
                                         f"the speed of plain ones (packing needs {MIN_PACK_SPEEDUP}x; {cache_path()})")


def measure_packing(budget_s: float = 0.12) -> dict:
    """Time a decode step's linear layers in float32, plain and prepacked, at 8 and at 32 rows, interleaved."""
    from grpo_pipeline.rollout.policy_copy import PackedLinear

    hidden, inter, layers, _ = _SHAPE
    gen = torch.Generator().manual_seed(0)
    plain = [torch.nn.Linear(i, o, bias=False) for _ in range(layers) for o, i in ((inter, hidden), (hidden, inter))]
    with torch.no_grad():
        for layer in plain:
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) * 0.02)
    packed = [PackedLinear(layer) for layer in plain]
    total = {"plain": 0.0, "packed": 0.0}
    for rows in (8, 32):
        small, large = torch.randn(rows, hidden, generator=gen), torch.randn(rows, inter, generator=gen)
        best = _best_ms({name: lambda stack=stack, x=(small, large): _stack_pass(stack, *x)
                         for name, stack in (("plain", plain), ("packed", packed))}, budget_s / 6)
        for name in total:
            total[name] += best[name]
    return {"plain_ms": round(total["plain"], 3), "packed_ms": round(total["packed"], 3),
            "measured": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu": cpu_name(), "threads": torch.get_num_threads()}


def bf16_timing(packed: bool) -> dict:
    """{float32_ms, bfloat16_ms}: one decode-like pass, cached per machine."""
    return _cached(_machine_key(packed), lambda: measure(packed))


def _cached(key: str, measure_now) -> dict:
    """The measurement stored under `key` in the machine's cache, measured (and stored) on first use."""
    path = cache_path()
    try:
        cached = json.loads(path.read_text()).get(key)
    except (OSError, ValueError):
        cached = None
    if cached:
        return cached
    timing = measure_now()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        data[key] = timing
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=2))
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: measure again next time
        log.warning("Could not cache the machine measurement in %s (%s)", path, e)
    return timing


def measure(packed: bool, budget_s: float = 0.12) -> dict:
    """Time the linear layers of a decode step in float32 (as the runtime runs it) and in bf16, interleaved."""
    from grpo_pipeline.rollout.policy_copy import PackedLinear

    hidden, inter, layers, rows = _SHAPE
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen) * 0.02 for _ in range(layers) for o, i in ((inter, hidden),
                                                                                           (hidden, inter))]
    if packed:
        fp32 = [PackedLinear(torch.nn.Linear(w.shape[1], w.shape[0], bias=False)) for w in weights]
        for layer, w in zip(fp32, weights, strict=True):
            with torch.no_grad():
                layer.weight.copy_(w)
            layer.repack()
    else:
        fp32 = [lambda x, w=w: torch.nn.functional.linear(x, w) for w in weights]
    bf16 = [lambda x, w=w.to(torch.bfloat16): torch.nn.functional.linear(x, w) for w in weights]
    inputs = {dtype: (torch.randn(rows, hidden, generator=gen).to(dtype), torch.randn(rows, inter, generator=gen).to(dtype))
              for dtype in (torch.float32, torch.bfloat16)}

    best = _best_ms({str(dtype).removeprefix("torch."): lambda stack=stack, x=inputs[dtype]: _stack_pass(stack, *x)
                     for stack, dtype in ((fp32, torch.float32), (bf16, torch.bfloat16))}, budget_s / 3)
    return {"float32_ms": round(best["float32"], 3), "bfloat16_ms": round(best["bfloat16"], 3),
            "measured": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu": cpu_name(), "threads": torch.get_num_threads()}


def _stack_pass(stack, small: torch.Tensor, large: torch.Tensor) -> None:
    """One decode-like pass over a stack of up/down projections (inputs alternate between their two widths)."""
    for i, layer in enumerate(stack):
        layer(small if i % 2 == 0 else large)


def _best_ms(passes: dict, slot_s: float) -> dict[str, float]:
    """Milliseconds a pass of each of `passes` takes: after a warm-up (oneDNN's kernel selection), three
    interleaved rounds of `slot_s` each, the best of each (another process's burst hits all of them alike)."""
    best = dict.fromkeys(passes, float("inf"))
    with torch.no_grad():
        for run in passes.values():
            run()
        for _ in range(3):
            for name, run in passes.items():
                started, n = time.perf_counter(), 0
                while n < 2 or time.perf_counter() - started < slot_s:
                    run()
                    n += 1
                best[name] = min(best[name], (time.perf_counter() - started) / n * 1000)
    return best


def _machine_key(packed: bool) -> str:
    flags = " ".join(sorted(cpu_flags() or []))
    raw = f"{cpu_name()}|{hashlib.sha1(flags.encode()).hexdigest()[:8]}|torch {torch.__version__}|" \
          f"{torch.get_num_threads()} threads|{'packed' if packed else 'plain'}"
    return raw
