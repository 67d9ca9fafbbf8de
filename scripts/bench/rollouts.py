"""HF (the runtime's decode loop) vs vLLM (vllm=colocate) for rollouts and whole training steps, side by side;
and the HF loop from its copy with prepacked weights (the default on a CPU) vs plain torch layers (`unpacked`);
and, for rollouts, transformers' own `model.generate` (`generate`: the merged copy in plain torch layers, every
turn prefilled from the start, no shared-prefix or turn cache: what "HF generate" means outside this runtime) and
transformers' continuous batching (`batching`: `model.generate_batch` with its paged KV cache, the same copy, every
turn prefilled from the start).

vLLM gets the policy both ways `vllm.weight_sync` offers: its weights (LoRA merged) loaded in place before each
rollout (`weights`), or the adapter as a LoRARequest (`adapter`). Runs in the CPU vLLM venv
(`make install-vllm`), on the default model (SmolLM2-135M + the default LoRA):

  rollout, single-turn   one step's completions of env=arithmetic (B prompts' groups of 4, 32 new tokens)
  rollout, 3-turn        8 episodes of env=hotel (up to 3 assistant turns of 64 tokens, the env's replies)
  whole step             a real training run per backend (training.max_steps=--steps, eval off; arithmetic in
                         the default shape, hotel with 8 episodes a step): median of TRL's step_time over the
                         steps after the first (the first warms vLLM up)

Same prompts, same sampling (temperature 1, no top-k/top-p). Each rollout figure is the median of --repeats
after a warm-up, the weight push included; the backends alternate.

    make install-vllm && .venv-vllm/bin/python scripts/bench/rollouts.py
    .venv/bin/python scripts/bench/rollouts.py --modes off unpacked generate batching  # the HF side alone, no vLLM
"""

import argparse
import contextlib
import functools
import statistics
import tempfile

import harness
import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16, help="single-turn completions per step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="training steps per backend (0: skip)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rollouts", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--step-envs", nargs="+", default=["arithmetic", "hotel"], choices=["arithmetic", "hotel"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                        help="off and unpacked alone run without vLLM: the HF side in the base venv (.venv)")
    args = parser.parse_args()
    harness.threads(args.threads)  # OMP_NUM_THREADS too: vLLM's CPU engine reads it

    harness.machine("SmolLM2-135M + LoRA r=16")
    table = harness.Table(f"{'part':<34}", *HEADER.values(), "unpacked / HF; HF / vLLM (weights, adapter); generate / HF")
    for env, batch, name in (("arithmetic", args.batch, f"rollout, single-turn, {args.batch} completions"),
                             ("hotel", 8, "rollout, 3-turn hotel, 8 episodes")) if args.rollouts else ():
        _row(table, name, _rollouts(table, env, batch, args.repeats, args.modes))
    if args.steps > 1:
        for env in args.step_envs:
            _row(table, f"whole step, {env}", {mode: _step_time(env, mode, args.steps) for mode in args.modes
                                               if mode not in LIBRARY})


# vllm=off (HF decode loop; `unpacked`: its copy without prepacked weights), vllm=colocate with each vllm.weight_sync,
# `generate`: transformers' model.generate, `batching`: its continuous batching (rollouts only)
MODES = ("off", "unpacked", "weights", "adapter", "generate", "batching")
SLOWER = ("unpacked", "generate", "batching")  # HF ways slower than the default loop: their ratio is theirs / off
LIBRARY = ("generate", "batching")  # transformers' own generation, rollouts only
HEADER = {"off": "HF decode", "unpacked": "HF unpacked", "weights": "vLLM weights", "adapter": "vLLM adapter",
          "generate": "generate", "batching": "cont. batching"}


def _overrides(mode: str) -> list[str]:
    if mode in ("off", "unpacked", *LIBRARY):
        return ["vllm=off", f"runtime.packed_generation={'null' if mode == 'off' else 'false'}"]
    return ["vllm=colocate", f"vllm.weight_sync={mode}"]


def _cells(values: dict[str, float], fmt: str, unit: str) -> list[str]:
    """One table cell per mode, in MODES' order; '-' for a mode not run."""
    return [f"{values[m]:{fmt}}{unit}" if m in values else "-" for m in MODES]


def _row(table, name: str, seconds: dict[str, float]) -> None:
    """Ratios to `off` (the default HF loop): unpacked / off and generate / off (what the loop's fast paths save),
    off / vLLM per weight sync; and generate / vLLM (vLLM against transformers' own generate)."""
    ratios = [(f"{seconds[m] / seconds['off']:.2f}x" if m in SLOWER else f"{seconds['off'] / seconds[m]:.2f}x")
              if "off" in seconds and m in seconds else "-" for m in MODES[1:]]
    ratios += [f"generate/{m} {seconds['generate'] / seconds[m]:.2f}x" for m in ("weights", "adapter")
               if "generate" in seconds and m in seconds]
    table.row(name, *_cells(seconds, ".2f", "s"), ", ".join(ratios))


def _rollouts(table, env_name: str, batch: int, repeats: int, modes: list[str]) -> dict[str, float]:
    from grpo_pipeline.recipe import sampling

    runs = {}
    for mode in modes:
        rollout, cfg, tokenizer, dataset, columns = harness.rollout(
            [f"env={env_name}", *_overrides(mode), "vllm.max_model_len=2048"])
        if mode in LIBRARY:
            rollout.reuse_cache = False  # every turn prefilled from the start, as generate() does
        runs[mode] = (rollout, cfg)
    policy = harness.lora_policy(cfg, tokenizer)  # the default: every linear layer
    for rollout, _ in runs.values():
        rollout.runner.bind(policy)
    prompts = [dataset[i // 4]["prompt"] for i in range(batch)]
    rows = [{c: dataset[i // 4][c] for c in columns} for i in range(batch)]
    sample = sampling(cfg.generation)

    tokens = {mode: [] for mode in modes}  # tokens sampled per rollout: the work each side did

    def timed(mode, repeat):
        torch.manual_seed(repeat)  # the HF loops (packed or not) then sample the same tokens in a repeat
        with _hf_generate({"generate": _generate, "batching": _continuous}.get(mode)):
            trajs = runs[mode][0].run(policy, prompts, rows, sample)
        tokens[mode].append(sum(sum(t.env_mask) for t in trajs))

    # one warm-up each (vLLM's first call is several times slower), then the modes in turn
    times = harness.alternate({mode: functools.partial(timed, mode) for mode in modes}, repeats)
    for rollout, _ in runs.values():
        rollout.close()
    table.row("  tokens sampled per rollout", *_cells({m: statistics.mean(t) for m, t in tokens.items()}, ".0f", ""),
              "")
    # the sides sample their own episodes, and a rollout of few prompts varies in length: also per token
    table.row("  ms per sampled token", *_cells({m: 1e3 * sum(times[m]) / sum(tokens[m][1:]) for m in modes},
                                                ".1f", ""), "")
    return harness.medians(times)


@contextlib.contextmanager
def _hf_generate(instead=None):
    """The runtime's turns sampled by `instead` (transformers' generate or continuous batching) instead of its own
    decode loop; None: its own."""
    from grpo_pipeline.rollout import turns as rollout

    own = rollout.generate
    if instead is not None:
        rollout.generate = instead
    try:
        yield
    finally:
        rollout.generate = own


def _generate(model, sequences, max_new_tokens, sampling, eos_ids, pad_id, prefix=None, with_logprobs=True,
              caches=None, snapshots=None):
    """rollout.generate's contract through model.generate: left-padded batch, the sampled tokens' log-probs from
    generate's raw logits / temperature (as the loop takes them, before top-k/top-p), cut after the first eos. The
    rollout still builds its shared-prefix cache (one prefill of the prefix per rollout), which this ignores."""
    from grpo_pipeline.rollout.decode import _cut_at_eos

    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, width - len(s):], mask[i, width - len(s):] = torch.tensor(s), 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    sample = bool(sampling.get("do_sample"))
    temperature = float(sampling.get("temperature") or 1.0) if sample else 1.0
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=sample,
                         temperature=float(sampling.get("temperature") or 1.0) if sample else None,
                         top_k=int(sampling.get("top_k") or 0) if sample else None,
                         top_p=float(sampling.get("top_p") or 1.0) if sample else None,
                         eos_token_id=list(eos_ids), pad_token_id=pad_id, output_logits=with_logprobs,
                         return_dict_in_generate=True)
    new = out.sequences[:, width:]
    logps = (torch.stack([torch.log_softmax(x.float() / temperature, -1) for x in out.logits], 1).gather(-1, new[..., None])
             .squeeze(-1).tolist() if with_logprobs else [[0.0] * new.size(1)] * new.size(0))
    return _cut_at_eos(new.tolist(), logps, eos_ids)


def _continuous(model, sequences, max_new_tokens, sampling, eos_ids, pad_id, prefix=None, with_logprobs=True,
                caches=None, snapshots=None):
    """rollout.generate's contract through transformers' continuous batching (model.generate_batch: a paged KV
    cache, requests scheduled as they finish, the sampled tokens' log-probs from its own sampler)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    from grpo_pipeline.rollout.decode import _cut_at_eos

    sample = bool(sampling.get("do_sample"))
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sample,
                              temperature=float(sampling.get("temperature") or 1.0) if sample else None,
                              top_k=int(sampling.get("top_k") or 0) if sample else None,
                              top_p=float(sampling.get("top_p") or 1.0) if sample else None,
                              eos_token_id=list(eos_ids), pad_token_id=pad_id)
    out = model.generate_batch([list(s) for s in sequences], generation_config=config, warmup=False,
                               continuous_batching_config=ContinuousBatchingConfig(return_logprobs=with_logprobs))
    results = list(out.values())
    if len(results) != len(sequences) or any(r.error for r in results):
        raise RuntimeError(f"continuous batching: {len(results)} of {len(sequences)} requests came back "
                           f"({[r.error for r in results if r.error][:1]})")
    new = [list(r.generated_tokens) for r in results]
    logps = [list(r.logprobs) if with_logprobs and r.logprobs else [0.0] * len(t)
             for r, t in zip(results, new, strict=True)]
    return _cut_at_eos(new, logps, eos_ids)


def _step_time(env_name: str, mode: str, steps: int) -> float:
    from grpo_pipeline.api import compose_config
    from grpo_pipeline.recipe import train
    from grpo_pipeline.tracking.mlflow_run import metric_history

    with tempfile.TemporaryDirectory() as tmp:
        db = f"sqlite:///{tmp}/mlflow.db"
        shape = ["training.batch_size=8", "generation.oversample=1"] if env_name == "hotel" else []  # 8 episodes
        cfg = compose_config([f"env={env_name}", *_overrides(mode), f"training.max_steps={steps}", "eval.enabled=false",
                              f"output_dir={tmp}/run", f"tracking.tracking_uri={db}", "ledger.enabled=false", *shape])
        result = train(cfg, launch_dir=tmp)
        values = metric_history(db, result.mlflow_run_id, "step_time")[1:]
    return statistics.median(values)


if __name__ == "__main__":
    main()
