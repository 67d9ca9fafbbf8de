"""What one decode step costs, by the weights that generate: fp32 in torch's own layers, fp32 prepacked for oneDNN
(`merged.PackedLinear`: what the runtime samples from on a CPU), bf16, and int8 (torch's dynamic quantization of
every Linear). SmolLM2-135M-Instruct, one new token per
row with a KV cache of --context tokens; each figure is the median of --repeats steps, all in one run. And how far
each copy's log-probs are from fp32's: the mean |log p - log p_fp32| of the next token over the rendered prompts of
env=arithmetic (teacher-forced; what a sampler's mismatch costs the loss's ratio).

    .venv/bin/python scripts/bench/decode.py                 # 8 and 32 rows
    .venv/bin/python scripts/bench/decode.py --rows 8 --context 500
"""

import argparse
import copy
import statistics
import warnings

import harness
import torch

from grpo_pipeline.rollout.decode import growing_cache


def step_seconds(model, rows: int, context: int, repeats: int) -> float:
    ids = torch.randint(100, 1000, (rows, context))
    with torch.no_grad():
        cache = [growing_cache(model(input_ids=ids, use_cache=True, logits_to_keep=1).past_key_values)]  # as the runtime
        token = torch.randint(100, 1000, (rows, 1))

        def step(_):
            cache[0] = model(input_ids=token, past_key_values=cache[0], use_cache=True, logits_to_keep=1).past_key_values

        return harness.median(step, repeats, warmup=0)  # the prefill above warmed it up


def logp_gap(model, reference, texts: list[list[int]]) -> float:
    """Mean |log p - log p_ref| of each actual next token over `texts` (token ids)."""
    gaps = []
    with torch.no_grad():
        for ids in texts:
            x = torch.tensor([ids])
            target = x[0, 1:, None]
            lp = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), -1).gather(-1, target)
            ref = torch.log_softmax(reference(input_ids=x).logits[0, :-1].float(), -1).gather(-1, target)
            gaps.append((lp - ref).abs().mean().item())
    return statistics.fmean(gaps)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    harness.threads(args.threads)
    warnings.filterwarnings("ignore")

    from grpo_pipeline.api import compose_config
    from grpo_pipeline.models import load_model, load_tokenizer
    from grpo_pipeline.prompts import render_prompt
    from grpo_pipeline.recipe import load_env_and_dataset
    from grpo_pipeline.rollout.policy_copy import pack_linears

    cfg = compose_config([])
    tokenizer = load_tokenizer(cfg.model)
    fp32 = load_model(cfg.model, tokenizer).eval()
    _, _, dataset, _ = load_env_and_dataset(cfg)
    texts = [tokenizer(render_prompt(tokenizer, dataset[i]["prompt"])[0], add_special_tokens=False)["input_ids"]
             for i in range(8)]
    packed = copy.deepcopy(fp32)
    pack_linears(packed)
    models = {"fp32": fp32, "packed": packed, "bf16": copy.deepcopy(fp32).to(torch.bfloat16),
              "int8": torch.ao.quantization.quantize_dynamic(copy.deepcopy(fp32), {torch.nn.Linear}, dtype=torch.qint8)}
    harness.machine(f"SmolLM2-135M; one decode step, KV cache of {args.context} tokens")
    gaps = {name: logp_gap(model, fp32, texts) for name, model in models.items()}
    print("mean |log p - log p_fp32| per token: " + ", ".join(f"{name} {gap:.4f}" for name, gap in gaps.items()))
    table = harness.Table("rows", *models, "fp32 / packed", "fp32 / int8")
    for rows in args.rows:
        s = {name: step_seconds(model, rows, args.context, args.repeats) for name, model in models.items()}
        table.row(rows, *map(harness.ms, s.values()), harness.ratio(s["fp32"], s["packed"]),
                  harness.ratio(s["fp32"], s["int8"]))


if __name__ == "__main__":
    main()
