"""What the base model's first turn (or its booking turn) does on env=hotel, per prompt variant: the cold start of a
multi-turn run, and what it starts from when it has to read the rooms' features.

GRPO learns only from groups whose rewards differ. If the base policy never calls search_rooms on its first turn,
a run with env.format_credit=search earns 0 on every episode until a later turn happens to search (measured: 21
all-zero steps on one seed). This samples the base model's first assistant turn the way training does (the run's
sampling settings, the env's prompts as built for training) and counts what it wrote: a search in the guest's
city, a search elsewhere, a booking, another tool, a malformed call, or plain text. Each variant is a set of
overrides, e.g. the default prompt against env.ask_to_search=true:

    .venv/bin/python scripts/bench/first_turn.py --prompts 12 --samples 4 "" "env.ask_to_search=true"

With --after-search the conversation goes on from a right search (the guest's city, guests and price cap, as the
scripted policy writes it) and the env's listing, and it counts the *booking* turn: the room meeting every wish,
the first room listed when that one misses a wish (the positional shortcut), another listed room, a room never
listed, another search, ... and, on the requests whose listing shows a wrong room first, how often the wished
room was booked (what reading the features buys over the shortcut; "reads features" in multiturn.py).
"""

import argparse
import collections
import time

import harness
import torch

from grpo_pipeline.api import compose_config
from grpo_pipeline.envs.hotel import listed_ids, right_search
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
BOOK_KINDS = ["wished room", "first listed, wrong", "other listed, wrong", "not listed", "search", "other tool",
              "malformed", "text"]


def after_search(env, prompt: list[dict], request: dict) -> tuple[list[dict], list[str]]:
    """The opening, a right search (as the scripted policy writes it) and the env's listing; the ids listed."""
    if isinstance(prompt, str):
        raise SystemExit("--after-search needs prompts as chat messages (a model with a chat template, e.g. the "
                         "default SmolLM2); this model's prompts were rendered to text")
    messages = [*prompt, {"role": "assistant", "content": right_search(request)}]
    messages.append(env.reply(messages, request))
    return messages, listed_ids(messages[-1]["content"])


def booking_kind(env, text: str, request: dict, listed: list[str]) -> str:
    first = kind(text, request)
    if first != "book_room":
        return "search" if first.startswith("search") else first
    room_id = str((parse_tool_calls(text)[0].get("arguments") or {}).get("room_id"))
    if room_id not in listed:
        return "not listed"
    if env.fits(env.rooms[room_id], request):
        return "wished room"
    return "first listed, wrong" if room_id == listed[0] else "other listed, wrong"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=12, help="requests sampled (the dataset's first rows)")
    parser.add_argument("--samples", type=int, default=4, help="turns sampled per request (a group)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--after-search", action="store_true",
                        help="sample the booking turn, after a right search and its listing")
    parser.add_argument("variants", nargs="*", default=[""], help="space-separated overrides per variant")
    args = parser.parse_args()
    harness.threads(args.threads)
    turn = "booking turn after a right search" if args.after_search else "first turn"
    harness.machine(f"base model's {turn} on env=hotel, {args.prompts} requests x {args.samples} samples")
    kinds_shown = BOOK_KINDS if args.after_search else KINDS
    last = ("wished room where a wrong room is listed first",) if args.after_search else ("groups with a search",)
    table = harness.Table("variant                     ", *kinds_shown, *last, "s")
    model = None
    for variant in args.variants:
        cfg = compose_config(["env=hotel", *variant.split()])
        env, tokenizer, dataset, _ = load_env_and_dataset(cfg)
        model = model or load_model(cfg.model, tokenizer).eval()
        counts, searched_groups, started = collections.Counter(), 0, time.monotonic()
        needs_reading = collections.Counter()
        for i, row in enumerate(dataset.select(range(args.prompts))):
            prompt, request, listed = row["prompt"], row["request"], []
            if args.after_search:
                prompt, listed = after_search(env, prompt, request)
            text = prompt if isinstance(prompt, str) else tokenizer.apply_chat_template(
                prompt, tokenize=False, add_generation_prompt=True)
            enc = tokenizer([text] * args.samples, return_tensors="pt", add_special_tokens=False)
            torch.manual_seed(i)
            with torch.no_grad():
                out = model.generate(**enc, **sampling(cfg.generation), max_new_tokens=args.max_new_tokens)
            texts = [tokenizer.decode(s, skip_special_tokens=True) for s in out[:, enc["input_ids"].shape[1]:]]
            if args.after_search:
                kinds = [booking_kind(env, t, request, listed) for t in texts]
                if listed and listed[0] in env.rooms and not env.fits(env.rooms[listed[0]], request):
                    needs_reading.update(k == "wished room" for k in kinds)
            else:
                kinds = [kind(t, request) for t in texts]
                searched_groups += any(k.startswith("search") for k in kinds)
            counts.update(kinds)
        n = sum(counts.values())
        tail = (f"{needs_reading[True]}/{sum(needs_reading.values())}" if args.after_search
                else f"{searched_groups}/{args.prompts}")
        table.row(variant or "(default)", *(f"{counts[k] / n:.2f}" for k in kinds_shown), tail,
                  f"{time.monotonic() - started:.0f}")


if __name__ == "__main__":
    main()
