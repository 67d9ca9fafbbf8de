"""Where a training step's time goes, and what the runtime's fast paths buy, side by side in one run.

On the default model (SmolLM2-135M-Instruct + LoRA r=16), with the prompts of env=arithmetic (and env=hotel
with --env hotel), for a batch of B completions (groups of 4 sharing a prompt):

  rollout:  HF `model.generate` on the LoRA model (sampling, output_logits for the log-probs)  vs  the runtime's
            decode loop (rollout/decode.py: shared-prefix KV cache, finished rows leave the batch, inverse-CDF
            sampling) on the merged copy of the policy (rollout/policy_copy.py), as the pipeline runs it
  loss:     forward + backward of the completion log-probs and entropies, TRL's own path  vs  the shared
            prompt prefix run once (training/prefix_logps.py)

Each figure is the median of --repeats timings after one warm-up; the two sides of a row run alternately.

    .venv/bin/python scripts/bench/step.py                  # B = 8 and 32, arithmetic
    .venv/bin/python scripts/bench/step.py --env hotel --batch 8 --tokens 64

With --profile it runs real training steps instead (the pipeline with the Hydra overrides given) and prints, per
step, the seconds of the rollout (its decode loop, the generation copy's refresh, the shared-prefix prefill), of
the loss forward, and of the whole training step. Nothing is changed in the run; the functions are only timed.

    .venv/bin/python scripts/bench/step.py --profile training.max_steps=3 eval.enabled=false
    .venv/bin/python scripts/bench/step.py --profile env=hotel training.max_steps=2 training.batch_size=8 \
        generation.oversample=1 generation.max_new_tokens=64 eval.enabled=false runtime.generation_dtype=float32
    .venv-vllm/bin/python scripts/bench/step.py --profile vllm=colocate training.max_steps=3 eval.enabled=false

Run it alone on the machine: two jobs on 2 cores slow each other several-fold.
"""

import argparse
import contextlib

import harness
import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--env", default="arithmetic", choices=["arithmetic", "hotel"])
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--tokens", type=int, default=32, help="max new tokens per completion")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lora-targets", default=None, help="comma-separated (default: every linear layer)")
    parser.add_argument("--profile", action="store_true", help="time the parts of real training steps instead")
    parser.add_argument("overrides", nargs="*", help="--profile: Hydra overrides of the training run")
    args = parser.parse_args()
    harness.threads(args.threads)
    if args.profile:
        return profile(args.overrides)

    from peft import LoraConfig, get_peft_model
    from trl.trainer.utils import add_fused_lm_head

    from grpo_pipeline.api import compose_config
    from grpo_pipeline.models import load_model, load_tokenizer, lora_target_modules
    from grpo_pipeline.recipe import load_env_and_dataset

    cfg = compose_config([f"env={args.env}"])
    tokenizer = load_tokenizer(cfg.model)
    _, _, dataset, _ = load_env_and_dataset(cfg)
    model = load_model(cfg.model, tokenizer)
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    model = get_peft_model(model, LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                                             target_modules=lora_target_modules(
                                                 args.lora_targets.split(",") if args.lora_targets else None),
                                             task_type="CAUSAL_LM"))
    harness.machine(f"SmolLM2-135M + LoRA r={cfg.lora.r}; env={args.env}; max {args.tokens} new tokens")
    table = harness.Table("B", "part    ", "baseline", "runtime", "ratio")
    for batch in args.batch:
        prompts = [_render(tokenizer, dataset[i // 4]["prompt"]) for i in range(batch)]
        seqs = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        hf, ours, completions = _time_rollouts(model, tokenizer, seqs, args.tokens, args.repeats)
        table.row(batch, "rollout", harness.secs(hf), harness.secs(ours), harness.ratio(hf, ours))
        trl, shared = _time_loss(model, seqs, completions, tokenizer.pad_token_id, args.repeats)
        table.row(batch, "loss", harness.secs(trl), harness.secs(shared), harness.ratio(trl, shared))
        table.row(batch, "together", harness.secs(hf + trl), harness.secs(ours + shared),
                  harness.ratio(hf + trl, ours + shared))


def _render(tokenizer, prompt) -> str:
    from grpo_pipeline.prompts import render_prompt

    return render_prompt(tokenizer, prompt)[0]


def _time_rollouts(model, tokenizer, seqs, tokens, repeats):
    from grpo_pipeline.rollout.policy_copy import MergedCopy
    from grpo_pipeline.rollout.turns import SharedPrefix, generate

    merged = MergedCopy()
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    eos = [tokenizer.eos_token_id]
    batch = tokenizer.pad({"input_ids": seqs}, return_tensors="pt")

    def hf():
        out = model.generate(**batch, max_new_tokens=tokens, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=eos, return_dict_in_generate=True, output_logits=True, **sampling)
        return out.sequences

    completions = []

    def ours():
        plain = merged.of(model)  # refreshed from the adapter every time, as in training
        ids, _ = generate(plain, seqs, tokens, sampling, eos, tokenizer.pad_token_id, SharedPrefix.build(plain, seqs))
        completions[:] = ids

    model.eval()
    with torch.no_grad():
        a, b = _alternate(hf, ours, repeats)
    model.train()
    return a, b, list(completions)


def _time_loss(model, seqs, completions, pad_id, repeats):
    from grpo_pipeline.training.prefix_logps import per_token_logps, shared_prefix_length

    width, length = max(map(len, seqs)), max(map(len, completions))
    ids = torch.full((len(seqs), width + length), pad_id)
    mask = torch.zeros_like(ids)
    for i, (s, c) in enumerate(zip(seqs, completions, strict=True)):
        ids[i, width - len(s):width], mask[i, width - len(s):width] = torch.tensor(s), 1
        ids[i, width:width + len(c)], mask[i, width:width + len(c)] = torch.tensor(c), 1
    keep = mask[:, -length:]

    def backward(logps, entropy):
        ((logps * keep).sum() + 0.1 * (entropy * keep).sum()).backward()
        model.zero_grad()

    def trl():
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :-length] = -100
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        backward(out.log_probs[:, -length:], out.entropy[:, -length:])

    prefix = shared_prefix_length(ids, mask, width)

    def shared():
        backward(*per_token_logps(model, ids, mask, length, prefix, True, len(seqs), contextlib.nullcontext))

    return _alternate(trl, shared, repeats)


def _alternate(first, second, repeats):
    med = harness.medians(harness.alternate({"first": lambda _: first(), "second": lambda _: second()}, repeats))
    return med["first"], med["second"]


def profile(overrides: list[str]) -> None:
    """Real training steps, with the parts of each timed (the code unchanged)."""
    from grpo_pipeline.api import train
    from grpo_pipeline.envs import runner
    from grpo_pipeline.rollout import decode as sampler
    from grpo_pipeline.rollout import policy_copy as merged
    from grpo_pipeline.rollout import turns as rollout
    from grpo_pipeline.rollout import vllm_engine as vllm_backend
    from grpo_pipeline.training import trainer

    seconds: dict[str, list[float]] = {}
    for owner, name, label in (
        (trainer.PipelineTrainer, "training_step", "training step"),
        (rollout.Rollout, "run", "rollout"),
        (runner.EpisodeRunner, "run_episodes", "env scoring"),  # a seed-style env's own turns run here
        (rollout.Rollout, "sample_for_env", "  env calls"),  # its recorded calls, by the decode loop
        (rollout, "decode", "  decode loop"),  # rollout.py calls sampler.decode by this name
        (merged.MergedCopy, "of", "  copy refresh"),
        (rollout.SharedPrefix, "build", "  prefix prefill"),
        (vllm_backend.VllmBackend, "sync", "  vllm sync"),  # vllm=colocate: the policy handed to vLLM
        (vllm_backend.VllmBackend, "generate", "  vllm turn"),
        (trainer.PipelineTrainer, "_compute_loss", "loss forward"),
        (trainer.PipelineTrainer, "_get_per_token_logps_and_entropies", "logps forwards"),  # loss, old, reference
    ):
        harness.record(owner, name, seconds.setdefault(label, []))
    assert rollout.decode is not sampler.decode
    harness.machine(f"overrides: {overrides}")
    train(overrides)
    print("\nseconds per call, in order:")
    for label, values in seconds.items():
        if values:
            print(f"{label:<16} " + " ".join(f"{v:6.2f}" for v in values))


if __name__ == "__main__":
    main()
