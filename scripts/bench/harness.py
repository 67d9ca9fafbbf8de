"""What every benchmark in scripts/bench/ shares: the machine line, thread counts, timing, markdown tables.

    import harness                      # the scripts run as `python scripts/bench/<name>.py`: this folder is on sys.path
    harness.threads(args.threads)       # before timing anything
    harness.machine("SmolLM2-135M + LoRA r=16")
    med = harness.medians(harness.alternate({"a": a, "b": b}, repeats=3))  # a(r), b(r) in turn, after a warm-up
    table = harness.Table("B", "a", "b", "a / b")
    table.row(8, harness.secs(med["a"]), harness.secs(med["b"]), harness.ratio(med["a"], med["b"]))
"""

import functools
import os
import statistics
import time
from collections.abc import Callable

import torch


def threads(n: int) -> int:
    """Use `n` threads, deliberately: torch's intra-op pool now, and OpenMP/MKL for what starts later (vLLM's
    engine, subprocesses). Two jobs on 2 cores slow each other several-fold: run a benchmark alone."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(n)
    torch.set_num_threads(n)
    return n


def machine(what: str = "") -> str:
    """Print (and return) the line every benchmark starts with: CPU, native bf16, cores, threads, torch, date."""
    from grpo_pipeline.config.machine import cpu_flags, cpu_name

    flags = cpu_flags()
    bf16 = "unknown" if flags is None else "yes" if "avx512_bf16" in flags else "no"
    line = (f"machine: {cpu_name()}, AVX512-BF16 {bf16}, {os.cpu_count()} cores, {torch.get_num_threads()} torch "
            f"threads, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}" + (f"; {what}" if what else ""))
    print(line, flush=True)
    return line


def alternate(fns: dict[str, Callable[[int], object]], repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds of each call of each fn: `warmup` untimed rounds, then `repeats` rounds, the fns in turn within a
    round (so a drift of the machine hits every side alike). Each fn gets the round: 0.., negative in warm-up."""
    for w in range(warmup):
        for fn in fns.values():
            fn(-1 - w)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(repeats):
        for name, fn in fns.items():
            started = time.perf_counter()
            fn(r)
            times[name].append(time.perf_counter() - started)
    return times


def median(fn: Callable[[int], object], repeats: int, warmup: int = 1) -> float:
    """Median seconds of `fn` over `repeats` calls after `warmup` untimed ones."""
    return statistics.median(alternate({"": fn}, repeats, warmup)[""])


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in times.items()}


def record(owner, name: str, into: list[float]) -> Callable[[], None]:
    """Time every call of `owner.name` (a method or a module function) into `into`, changing nothing else.
    Returns the undo."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - started)

    setattr(owner, name, timed)
    return lambda: setattr(owner, name, original)


def rollout(overrides: list[str]):
    """The runtime's rollout as a run with `overrides` builds it (its plan decides: config/plan.py), without weights.
    Returns (rollout, cfg, tokenizer, dataset, the dataset's columns but the prompt)."""
    from grpo_pipeline.api import compose_config
    from grpo_pipeline.config.plan import make_plan
    from grpo_pipeline.envs.runner import EpisodeRunner
    from grpo_pipeline.evaluation.heldout import Split
    from grpo_pipeline.recipe import load_env_and_dataset, sampling
    from grpo_pipeline.rollout.turns import make_rollout

    cfg = compose_config(overrides)
    env, tokenizer, dataset, tools = load_env_and_dataset(cfg, render_tools=False)
    plan = make_plan(cfg, env, tokenizer, Split(dataset, None, None), tools, type(env).__qualname__)
    columns = [c for c in dataset.column_names if c != "prompt"]
    runner = EpisodeRunner(env, tokenizer, cfg.runtime, columns, sampling=sampling(cfg.generation))
    from grpo_pipeline.models import model_dir

    return make_rollout(plan, env, tokenizer, runner, lambda: model_dir(cfg.model)), cfg, tokenizer, dataset, columns


def lora_policy(cfg, tokenizer, targets: list[str] | None = None):
    """The model of `cfg` with a fresh LoRA adapter as `cfg.lora` configures it (`targets` in place of its own)."""
    from peft import LoraConfig, get_peft_model

    from grpo_pipeline.models import load_model, lora_target_modules

    return get_peft_model(load_model(cfg.model, tokenizer), LoraConfig(
        r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout, task_type="CAUSAL_LM",
        target_modules=lora_target_modules(targets or cfg.lora.target_modules)))


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x"


def secs(s: float) -> str:
    return f"{s:.2f}s"


def ms(s: float) -> str:
    return f"{1000 * s:.1f}ms"


class Table:
    """A markdown table printed a row at a time, so a long benchmark shows each row as soon as it is measured.
    A column is as wide as its header (pad a header to widen it); the first is left-aligned, the others right."""

    def __init__(self, *header: str):
        self.widths = [max(len(h), 6) for h in header]
        print("\n" + self._line(header))
        print("|" + "|".join("-" * (w + 2) for w in self.widths) + "|", flush=True)

    def row(self, *cells) -> None:
        print(self._line([str(c) for c in cells]), flush=True)

    def _line(self, cells) -> str:
        first, *rest = cells
        return "| " + " | ".join([f"{first:<{self.widths[0]}}"] + [
            f"{c:>{w}}" for c, w in zip(rest, self.widths[1:], strict=False)]) + " |"
