"""What the base model's first turn does on env=hotel, per prompt variant: the cold start of a multi-turn run.

GRPO learns only from groups whose rewards differ. If the base policy never calls search_rooms on its first turn,
a run with env.format_credit=search earns 0 on every episode until a later turn happens to search (measured: 21
all-zero steps on one seed). This samples the base model's first assistant turn the way training does (the run's
sampling settings, the env's prompts as built for training) and counts what it wrote: a search in the guest's
city, a search elsewhere, a booking, another tool, a malformed call, or plain text. Each variant is a set of
overrides, e.g. the default prompt against env.ask_to_search=true:

    .venv/bin/python scripts/bench/first_turn.py --prompts 12 --samples 4 "" "env.ask_to_search=true"
"""

import argparse
import collections
import time

import harness
import torch

from grpo_pipeline.api import compose_config
from grpo_pipeline.models import load_model
from grpo_pipeline.prompts import parse_tool_calls
from grpo_pipeline.recipe import load_env_and_dataset, sampling


def kind(text: str, request: dict) -> str:
    calls = parse_tool_calls(text)
    if calls is None:
        return "malformed"
    if not calls:
        return "text"
    name = str(calls[0].get("name"))
    if name == "search_rooms":
        city = str((calls[0].get("arguments") or {}).get("city", "")).lower()
        return "search, guest's city" if city == request["city"].lower() else "search, other city"
    return "book_room" if name == "book_room" else "other tool"


KINDS = ["search, guest's city", "search, other city", "book_room", "other tool", "malformed", "text"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=12, help="requests sampled (the dataset's first rows)")
    parser.add_argument("--samples", type=int, default=4, help="first turns sampled per request (a group)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("variants", nargs="*", default=[""], help="space-separated overrides per variant")
    args = parser.parse_args()
    harness.threads(args.threads)
    harness.machine(f"base model's first turn on env=hotel, {args.prompts} requests x {args.samples} samples")
    table = harness.Table("variant                     ", *KINDS, "groups with a search", "s")
    model = None
    for variant in args.variants:
        cfg = compose_config(["env=hotel", *variant.split()])
        env, tokenizer, dataset, _ = load_env_and_dataset(cfg)
        model = model or load_model(cfg.model, tokenizer).eval()
        counts, searched_groups, started = collections.Counter(), 0, time.monotonic()
        for i, row in enumerate(dataset.select(range(args.prompts))):
            prompt = row["prompt"]
            text = prompt if isinstance(prompt, str) else tokenizer.apply_chat_template(
                prompt, tokenize=False, add_generation_prompt=True)
            enc = tokenizer([text] * args.samples, return_tensors="pt", add_special_tokens=False)
            torch.manual_seed(i)
            with torch.no_grad():
                out = model.generate(**enc, **sampling(cfg.generation), max_new_tokens=args.max_new_tokens)
            kinds = [kind(tokenizer.decode(s, skip_special_tokens=True), row["request"])
                     for s in out[:, enc["input_ids"].shape[1]:]]
            counts.update(kinds)
            searched_groups += any(k.startswith("search") for k in kinds)
        n = sum(counts.values())
        table.row(variant or "(default)", *(f"{counts[k] / n:.2f}" for k in KINDS),
                  f"{searched_groups}/{args.prompts}", f"{time.monotonic() - started:.0f}")


if __name__ == "__main__":
    main()
