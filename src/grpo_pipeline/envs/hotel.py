"""Multi-turn hotel booking with tools and a scripted guest.

The guest asks for a room (city, guests, price cap, wished features). The assistant calls
`search_rooms` and `book_room` by writing `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(parsed with json, never executed as code). The env owns the conversation, the runtime the generation
(rollout/turns.py): after each assistant turn, `respond` runs its tool calls and returns the results
(or the guest's nudge when it called none), and the episode ends at a booking or after `max_turns`
assistant turns. Every assistant turn is trained; the env's turns are masked out of the loss.
`score_episode` reads the whole transcript. Score, from the first booking:
1.0 a room meeting every wish; 0.3 + 0.6 * (share of wishes met) another room a search of this episode showed;
0.2 no such booking but a search in the right city; 0.1 a well-formed tool call; else 0. With
`format_credit="search"` only a search_rooms call earns that 0.1: a blind booking or a call to a tool that does not
exist earns 0, so a search is the only step up from a guess. With `ask_to_search=True` the guest's request ends with
the nudge's sentence ("Please search for rooms and book one that meets all my wishes."): SmolLM2-135M's first turn,
sampled at temperature 1, then searches on 10-16% of requests instead of 0% (it copies the worked example's booking),
so GRPO has a search to reinforce from the first step (docs/results.md, 2026-12-07 evening). With
`listing_hint=True` every listing (the worked example's too) ends "To book one of these rooms, call book_room with
its room_id.": after a right search the base model then books a listed room on 29% of samples instead of 8% (it
otherwise writes text or calls made-up tools, and a trained policy that found the search repeats it; docs/results.md,
2026-12-07 night).
A room no search showed (a guess, or the worked example's room copied) earns no booking credit: before that rule,
a 30-minute normal-difficulty run collapsed into booking the example's POR-101 for every guest without searching
(0.3 + 0.6 * share for any real room beat the 0.2 of a search; docs/results.md, multi-turn).
A search lists rooms in a fixed order, so "search with the guest's city, guests and price cap, book the first room
listed" (blind to the wished features) scores 1.0 on easy and, on normal, 0.896 mean / 0.58 success on the default
test requests: every normal-difficulty run that learned so far stopped exactly there (scripts/bench/multiturn.py
prints this scripted policy's figures beside the runs). With `shuffle_results=True` a search lists its rooms in an
order that changes with the exact call the assistant wrote (fixed for a given call and request, so a greedy held-out
episode sees the same order every time): the first room listed is then right on 67% of the normal requests on
average (72% in the fixed order), episodes that wrote their search differently may see different rooms first, and
only reading the features books the right room reliably (docs/results.md, 2026-12-07 afternoon).
The four options are off here and on in conf/env/hotel.yaml (env=hotel's defaults since 2026-12-07 late night).
`shuffle_per_episode` (with shuffle_results, default off) lets a training episode's `episode_seed` (the runtime's,
docs/envs.md) join the draw, so the 4 episodes of a group that wrote the same search see 4 orders and "book the first
listed" is right in some and wrong in others; held-out episodes (seed None) see the call's order as before. Measured
on untuned seed 30 (2026-12-08): held-out success 0.67 -> 0.75 whole-trajectory, 0.67 -> 0.67 seed-style, neither
reading the wished feature on a held-out request: no better than without it, so it stays off.
`booking_starts` (a share, default 0) adds, for that share of the requests whose right search lists 2+ rooms, a row
whose opening already holds that search and its listing (`starts_at="booking"`), so a group compares bookings from
one listing; the held-out split groups rows by request, so the test requests are the same full episodes. Measured:
1.0 broke the search on seed 23 (its booking argument leaked into the search call) and taught "book the last listed",
not reading (docs/results.md, 2026-12-07 late night); kept for scripts/bench/multiturn.py --modes booking-only.
"""

import hashlib
import json
import random

from datasets import Dataset

from grpo_pipeline.prompts import parse_tool_calls

CITIES = ["Lisbon", "Porto", "Madrid", "Paris"]
FEATURES = ["sea view", "breakfast", "balcony", "quiet"]
_DIFFICULTY_FEATURES = {"easy": 0, "normal": 1, "hard": 2}

SYSTEM = (
    "You are a hotel booking assistant. Tools: search_rooms(city, guests, max_price) lists matching rooms; "
    "book_room(room_id) books one. Call a tool by writing "
    '<tool_call>{"name": "search_rooms", "arguments": {"city": "Lisbon", "guests": 2, "max_price": 100}}</tool_call>. '
    "Book exactly one room that meets every wish of the guest."
)
NUDGE = "Please search for rooms and book one that meets all my wishes."
LISTING_HINT = "To book one of these rooms, call book_room with its room_id."
MALFORMED = 'Your <tool_call> was not valid JSON. Write <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'


def format_rooms(rooms: list[dict]) -> str:
    """Search results as the model reads them: one short line per room (a JSON dump costs ~45 tokens a room)."""
    return "\n".join(f"{r['room_id']}: {r['capacity']} guests, {r['price']} EUR, "
                     f"{', '.join(r['features']) or 'no extras'}" for r in rooms)


def listed_ids(content) -> list[str]:
    """The room ids a tool message lists, in order (what `format_rooms` wrote: the text before each line's colon;
    a line with no colon, such as the listing's hint, lists none)."""
    return [line.split(":", 1)[0] for line in str(content or "").splitlines() if ":" in line]


class HotelEnv:
    thread_safe = True  # score_episode keeps its state in locals

    def __init__(
        self,
        num_samples: int = 200,
        max_turns: int = 3,
        difficulty: str = "normal",
        turn_max_new_tokens: int = 64,
        num_shot: int = 1,
        seed: int = 0,
        shuffle_results: bool = False,
        format_credit: str = "any",
        ask_to_search: bool = False,
        listing_hint: bool = False,
        booking_starts: float = 0.0,
        shuffle_per_episode: bool = False,
    ):
        if difficulty not in _DIFFICULTY_FEATURES:
            raise ValueError(f"difficulty={difficulty!r}; use one of {list(_DIFFICULTY_FEATURES)}")
        if max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        self.num_samples, self.max_turns, self.difficulty = num_samples, max_turns, difficulty
        self.turn_max_new_tokens = turn_max_new_tokens
        self.num_shot = num_shot
        self.shuffle_results = shuffle_results
        if shuffle_per_episode and not shuffle_results:
            raise ValueError("shuffle_per_episode=true reshuffles the order shuffle_results draws: set "
                             "shuffle_results=true too")
        self.shuffle_per_episode = shuffle_per_episode
        if format_credit not in ("any", "search"):
            raise ValueError(f"format_credit={format_credit!r}: use 'any' (0.1 for any well-formed tool call) or "
                             "'search' (0.1 for a well-formed search_rooms call only)")
        self.format_credit = format_credit
        self.ask_to_search = ask_to_search
        self.listing_hint = listing_hint
        if not 0.0 <= booking_starts <= 1.0:
            raise ValueError(f"booking_starts={booking_starts!r}: a share of the requests, from 0.0 (none) to 1.0")
        self.booking_starts = booking_starts
        rng = random.Random(seed)
        self.rooms = {}
        for city in CITIES:
            for n in range(6):
                self.rooms[f"{city[:3].upper()}-{101 + n}"] = {
                    "room_id": f"{city[:3].upper()}-{101 + n}",
                    "city": city,
                    "capacity": rng.randint(1, 4),
                    "price": rng.randrange(60, 260, 10),
                    "features": sorted(rng.sample(FEATURES, rng.randint(0, 3))),
                }
        self.seed = seed

    heldout_group_by = ["request"]  # a request's booking-start row stays on its full episode's side of the split
    describes_tools = True  # SYSTEM names both tools and the call format: no tools preamble on templates without tools

    def get_tools(self) -> list[dict]:
        def fn(name, description, properties, required):
            return {
                "type": "function",
                "function": {
                    "name": name,
                    "description": description,
                    "parameters": {"type": "object", "properties": properties, "required": required},
                },
            }

        return [
            fn(
                "search_rooms",
                "List available rooms in a city for a number of guests under a nightly price cap.",
                {"city": {"type": "string"}, "guests": {"type": "integer"}, "max_price": {"type": "number"}},
                ["city"],
            ),
            fn("book_room", "Book one room by its id.", {"room_id": {"type": "string"}}, ["room_id"]),
        ]

    def build_dataset(self, tokenizer) -> Dataset:
        rng = random.Random(self.seed + 1)
        rooms = list(self.rooms.values())
        rows = []
        for _ in range(self.num_samples):
            target = rng.choice(rooms)  # the request is built from a real room, so a right answer exists
            wishes = rng.sample(target["features"], min(len(target["features"]), _DIFFICULTY_FEATURES[self.difficulty]))
            slack = 0 if self.difficulty == "hard" else rng.choice([0, 20, 40])
            request = {
                "city": target["city"],
                "guests": rng.randint(1, target["capacity"]),
                "max_price": target["price"] + slack,
                "features": wishes,
            }
            rows.append({"prompt": self._opening(request), "request": request, "starts_at": "request"})
        # booking starts go after every full row: the held-out split (grouped by request) then keeps the same test
        # requests, each as its full episode, and a test request's booking start is never trained on
        pick = random.Random(self.seed + 2)
        for row in list(rows) if self.booking_starts else []:
            given = self._given(row["request"], "booking")  # the search and its listing, played once
            if len(listed_ids(given[-1]["content"])) > 1 and pick.random() < self.booking_starts:  # one room: no choice
                rows.append({"prompt": [*row["prompt"], *given], "request": row["request"], "starts_at": "booking"})
        return Dataset.from_list(rows)

    def _opening(self, request: dict, starts_at: str = "request") -> list[dict]:
        return [{"role": "system", "content": SYSTEM}] + self._worked_example() * min(self.num_shot, 1) + [
            {"role": "user", "content": _ask(request, self.ask_to_search)}] + self._given(request, starts_at)

    def _given(self, request: dict, starts_at: str) -> list[dict]:
        """The turns a row's opening has already played: none for a full episode ("request"); for a booking start
        ("booking", env.booking_starts) the right search, written as the scripted policy writes it, and the env's
        listing for it (in the order that call gets), so the assistant's first turn is the booking."""
        if starts_at == "request":
            return []
        if starts_at != "booking":
            raise ValueError(f"starts_at={starts_at!r}: a hotel row starts at 'request' or 'booking'")
        search = [{"role": "assistant", "content": right_search(request)}]
        return [*search, self.reply(search, request)]

    def _worked_example(self) -> list[dict]:
        """One solved booking (search, result, booking), so a small model sees the tool-call format."""
        room = self.rooms["POR-101"]
        request = {"city": "Porto", "guests": 1, "max_price": room["price"], "features": room["features"][:1]}
        return [
            {"role": "user", "content": _ask(request, self.ask_to_search)},
            {"role": "assistant", "content": right_search(request)},
            {"role": "tool", "content": self._listing([room])},
            {"role": "assistant", "content": tool_call("book_room", {"room_id": room["room_id"]})},
            {"role": "tool", "content": "booked"},
        ]

    # --- tools -------------------------------------------------------------------------------------
    def search_rooms(self, city: str = "", guests: int = 1, max_price: float = 10_000) -> list[dict]:
        return [
            r
            for r in self.rooms.values()
            if r["city"].lower() == str(city).lower()
            and r["capacity"] >= _as_number(guests, 1)
            and r["price"] <= _as_number(max_price, 10_000)
        ]

    def fits(self, room: dict, request: dict) -> bool:
        """Whether `room` meets every wish of `request` (what a booking needs to score 1.0)."""
        met, total = self.wishes_met(room, request)
        return met == total

    def wishes_met(self, room: dict, request: dict) -> tuple[int, int]:
        checks = [
            room["city"] == request["city"],
            room["capacity"] >= request["guests"],
            room["price"] <= request["max_price"],
        ] + [f in room["features"] for f in request["features"]]
        return sum(checks), len(checks)

    # --- the episode (the runtime generates the assistant's turns; see rollout/turns.py) ---------------
    def respond(self, messages: list[dict], request: dict, episode_seed: int | None = None, **_) -> dict | None:
        """The env's reply to the assistant's last turn: the results of its tool calls, a nudge when it called
        none (or wrote a malformed call), or None once it has booked a room (the episode is over).
        `episode_seed`: the runtime's seed for this training episode (None held out; see shuffle_per_episode)."""
        return self.reply(messages, request, episode_seed)

    def reply(self, messages: list[dict], request: dict, episode_seed: int | None = None) -> dict | None:
        calls = parse_tool_calls(messages[-1]["content"])
        if calls is None:
            return {"role": "user", "content": MALFORMED}
        if not calls:
            return {"role": "user", "content": NUDGE}
        results = []
        for call in calls:
            name, args = call.get("name"), call.get("arguments", {})
            if name == "book_room":
                return None
            if name == "search_rooms":
                found = self.search_rooms(**{k: v for k, v in args.items() if k in ("city", "guests", "max_price")})
                if self.shuffle_results:
                    found = self._listing_order(found, messages[-1]["content"], request, episode_seed)
                results.append(self._listing(found) if found else "no rooms match")
            else:
                results.append(f"error: unknown tool {name!r}")
        return {"role": "tool", "content": "\n".join(results)}

    def _listing(self, rooms: list[dict]) -> str:
        """A search's result as the model reads it: the rooms, then (env.listing_hint) how to book one."""
        return format_rooms(rooms) + (f"\n{LISTING_HINT}" if self.listing_hint else "")

    def _listing_order(self, rooms: list[dict], call: str, request: dict, episode_seed: int | None = None
                       ) -> list[dict]:
        """`rooms` in an order drawn from the assistant's exact turn and the request (sha256, not Python's salted
        hash): two episodes that wrote their search differently see different orders, the same one the same. With
        shuffle_per_episode, a training episode's seed joins the draw: each episode of a group sees its own order."""
        salt = f"{episode_seed}|" if self.shuffle_per_episode and episode_seed is not None else ""
        key = f"{self.seed}|{json.dumps(request, sort_keys=True)}|{call}|{salt}"
        return sorted(rooms, key=lambda r: hashlib.sha256((key + r["room_id"]).encode()).digest())

    def score_turn(self, messages: list[dict], request: dict, **_) -> float:  # a booking start's search is in messages
        """runtime.turn_credit=turn: a little credit (0.1) for an assistant turn whose tool call is useful, the
        episode's first search in the guest's city or the booking of a room a search showed; 0 otherwise. The
        episode's reward (up to 1) still decides; this only tells which turn helped."""
        messages = _episode(messages, _ask(request, self.ask_to_search))  # the worked example's search and POR-101 listing are not this episode's
        calls = parse_tool_calls(messages[-1].get("content") or "") or []
        earlier = [c for m in messages[:-1] if m.get("role") == "assistant" for c in parse_tool_calls(m["content"]) or []]
        shown = {i for m in messages if m.get("role") == "tool" for i in listed_ids(m.get("content"))}
        for call in calls:
            args = call.get("arguments", {})
            if call.get("name") == "search_rooms" and str(args.get("city", "")).lower() == request["city"].lower():
                if not any(c.get("name") == "search_rooms" for c in earlier):
                    return 0.1
            elif call.get("name") == "book_room" and str(args.get("room_id")) in shown:
                return 0.1
        return 0.0

    def score_episode(self, model, tokenizer, completion: list[dict] | str, request: dict,
                      starts_at: str = "request", **_) -> float:
        """`completion`: the episode's messages after the opening (or, from older callers, the first reply). A
        booking start's episode is scored with its opening's search and listing before it."""
        messages = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else completion
        messages = [*self._given(request, starts_at), *messages]
        searched = well_formed = False
        shown: set[str] = set()  # room ids the env's search results listed so far
        for message in messages:
            if message.get("role") == "tool":
                shown |= set(listed_ids(message.get("content")))
            if message.get("role") != "assistant":
                continue
            for call in parse_tool_calls(message["content"]) or []:
                well_formed = well_formed or self.format_credit == "any" or call.get("name") == "search_rooms"
                args = call.get("arguments", {})
                if call.get("name") == "search_rooms":
                    searched = searched or str(args.get("city", "")).lower() == request["city"].lower()
                elif call.get("name") == "book_room":
                    room_id = str(args.get("room_id"))
                    booked = self.rooms.get(room_id)
                    if booked is None or room_id not in shown:
                        return 0.2 if searched else 0.1 if well_formed else 0.0
                    met, total = self.wishes_met(booked, request)
                    return 1.0 if met == total else 0.3 + 0.6 * met / total
        return 0.2 if searched else 0.1 if well_formed else 0.0

    def episode_metrics(self, completion: list[dict], request: dict, **_) -> dict[str, float]:
        """Logged per step as env/<name> (batch means)."""
        parsed = [parse_tool_calls(m["content"]) for m in completion if m.get("role") == "assistant"]
        return {"tool_calls": float(sum(len(p) for p in parsed if p)),
                "malformed_tool_calls": float(sum(p is None for p in parsed))}


def tool_call(name: str, arguments: dict) -> str:
    """A tool call as the assistant writes it (and the env parses it)."""
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def right_search(request: dict) -> str:
    """The search a request asks for: the guest's city, guests and price cap (the worked example's and the scripted
    policies' first turn)."""
    return tool_call("search_rooms", {k: request[k] for k in ("city", "guests", "max_price")})


def _ask(request: dict, ask_to_search: bool = False) -> str:
    wish = f", with {' and '.join(request['features'])}" if request["features"] else ""
    return (f"Hi! I need a room in {request['city']} for {request['guests']} guest(s), "
            f"at most {request['max_price']} EUR per night{wish}." + (f" {NUDGE}" if ask_to_search else ""))


def _episode(messages: list[dict], ask: str) -> list[dict]:
    """The messages after the guest's request (score_turn gets the whole conversation, the opening's worked example
    included); all of them when the request is not among them."""
    starts = [i for i, m in enumerate(messages) if m.get("role") == "user" and m.get("content") == ask]
    return messages[starts[-1] + 1:] if starts else messages


def _as_number(value, default: float) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


class HotelSeedEnv(HotelEnv):
    """The same task written the documents' way: no `respond`; `score_episode` runs the conversation itself,
    generating turns 2.. `max_turns` with `model.generate` (python -m grpo_pipeline env=hotel_seed). In training,
    those calls' samples are trained as rows of their own with the episode's advantage (runtime.train_env_calls);
    with runtime.train_env_calls=false only the first reply is."""

    respond = None  # the env runs its own turns

    def score_episode(self, model, tokenizer, completion, request: dict, starts_at: str = "request",
                      episode_seed: int | None = None, **_) -> float:
        text = completion if isinstance(completion, str) else "".join(
            str(m.get("content") or "") for m in completion if m.get("role") == "assistant")
        opening = self._opening(request, starts_at)
        messages = [*opening, {"role": "assistant", "content": text}]
        for _turn in range(self.max_turns - 1):
            reply = self.reply(messages, request, episode_seed)
            if reply is None:
                break
            messages.append(reply)
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
            out = model.generate(input_ids=inputs["input_ids"].to(model.device),
                                 attention_mask=inputs["attention_mask"].to(model.device),
                                 max_new_tokens=self.turn_max_new_tokens)
            answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
            messages.append({"role": "assistant", "content": answer})
        return super().score_episode(model, tokenizer, messages[len(opening):], request, starts_at)
