"""The shipped example envs: datasets, scores, multi-turn episodes, and no eval/exec of model output."""

import json
import re
from pathlib import Path

import pytest

from grpo_pipeline.envs.arithmetic import ArithmeticEnv
from grpo_pipeline.envs.hotel import LISTING_HINT, HotelEnv, listed_ids, parse_tool_calls
from grpo_pipeline.models import build_tiny_tokenizer
from grpo_pipeline.prompts import supports_tools


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def test_arithmetic_dataset_and_scores(tokenizer):
    env = ArithmeticEnv(num_samples=20, num_shot=1, seed=3)
    ds = env.build_dataset(tokenizer)
    assert len(ds) == 20 and ds.column_names == ["prompt", "answer"]
    first = ds[0]
    assert first["prompt"][-1]["content"].startswith("What is ") and first["prompt"][1]["role"] == "assistant"
    a, b = map(int, re.findall(r"\d+", first["prompt"][-1]["content"])[:2])
    assert first["answer"] == a + b
    score = lambda text: env.score_episode(None, tokenizer, text, answer=57)  # noqa: E731
    assert score("<answer>57</answer>") == pytest.approx(1.0)
    assert score("<answer>56</answer>") == pytest.approx(0.2)
    assert score("12 + 45 = 57") == pytest.approx(0.8)  # last number, no tag
    assert score("12 + 45 = 57 <answer> 57 </answer>") == pytest.approx(1.0)
    assert score("no idea") == 0.0


def test_arithmetic_rejects_bad_kwargs():
    with pytest.raises(ValueError, match="operations"):
        ArithmeticEnv(operations=["/"])
    with pytest.raises(ValueError, match="sum to 1"):
        ArithmeticEnv(format_weight=0.5, answer_weight=0.8)


def play(env, request, replies):
    """An episode as the runtime plays it: each scripted assistant turn, then the env's reply, until done."""
    transcript = []
    for reply in replies:
        transcript.append({"role": "assistant", "content": reply})
        answer = env.respond(env._opening(request) + transcript, request=request)
        if answer is None:
            break
        transcript.append(answer)
    return transcript


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def matching_room(env, request):
    rooms = [r for r in env.rooms.values() if env.wishes_met(r, request)[0] == env.wishes_met(r, request)[1]]
    assert rooms, "the request was built from a real room"
    return rooms[0]


def test_hotel_multi_turn_episode_books_the_right_room(tokenizer):
    env = HotelEnv(num_samples=5, max_turns=3, difficulty="normal")
    request = env.build_dataset(tokenizer)[0]["request"]
    room = matching_room(env, request)
    first = call("search_rooms", city=request["city"], guests=request["guests"], max_price=request["max_price"])
    transcript = play(env, request, [first, call("book_room", room_id=room["room_id"])])
    assert [m["role"] for m in transcript] == ["assistant", "tool", "assistant"]  # booked: the env ended it
    assert room["room_id"] in transcript[1]["content"]  # the search's result showed the room
    assert env.score_episode(None, tokenizer, transcript, request=request) == 1.0


def test_hotel_scores_follow_the_booking(tokenizer):
    env = HotelEnv(num_samples=5, max_turns=2, difficulty="hard", seed=1)
    request = env.build_dataset(tokenizer)[0]["request"]
    wrong_city = next(r for r in env.rooms.values() if r["city"] != request["city"])
    met, total = env.wishes_met(wrong_city, request)
    assert met < total
    score = lambda replies: env.score_episode(None, tokenizer, play(env, request, replies), request=request)  # noqa: E731
    # a room a search showed (here in the wrong city) earns partial credit for the wishes it meets
    searched_there = [call("search_rooms", city=wrong_city["city"], guests=1, max_price=10_000),
                      call("book_room", room_id=wrong_city["room_id"])]
    assert score(searched_there) == pytest.approx(0.3 + 0.6 * met / total)
    # the same room booked blind (no search showed it: a guess, or the worked example's room copied) earns none,
    # also when it would meet every wish: a collapsed run booked the example's room for every guest this way
    assert score([call("book_room", room_id=wrong_city["room_id"])]) == 0.1
    right = matching_room(env, request)
    assert score([call("book_room", room_id=right["room_id"])]) == 0.1
    nothing_shown = call("search_rooms", city=request["city"], max_price=0)  # "no rooms match"
    assert score([nothing_shown, call("book_room", room_id=right["room_id"])]) == 0.2
    assert score([call("search_rooms", city=request["city"]), call("book_room", room_id=right["room_id"])]) == 1.0
    assert score([call("search_rooms", city=request["city"]), "I am not sure."]) == 0.2  # searched, never booked
    assert score([call("dance"), "hmm"]) == 0.1  # a well-formed call to an unknown tool, then chatter
    transcript = play(env, request, ["hello", "hmm"])
    assert score(["hello", "hmm"]) == 0.0 and "Please search for rooms" in transcript[1]["content"]  # nudged


def test_hotel_format_credit_search_pays_only_searches(tokenizer):
    """env.format_credit=search: the 0.1 for a well-formed call goes to search_rooms calls alone; a blind booking
    (the trap normal runs settle in) and a made-up tool (where a policy went when blind bookings earned 0) earn 0."""
    env = HotelEnv(format_credit="search")
    request = env.build_dataset(tokenizer)[0]["request"]
    right = matching_room(env, request)
    score = lambda replies: env.score_episode(None, tokenizer, play(env, request, replies), request=request)  # noqa: E731
    assert score([call("book_room", room_id=right["room_id"])]) == 0.0  # a guess earns nothing, even a right one
    assert score([call("book_room", room_id="XYZ-999")]) == 0.0
    assert score([call("book_bedroom", quality=25), call("rooms_hotel", type="booking")]) == 0.0
    assert score([call("search_rooms", city="Nowhere")]) == 0.1  # a search anywhere is the step up
    assert score([call("search_rooms", city="Nowhere"), call("book_room", room_id=right["room_id"])]) == 0.1
    assert score([call("search_rooms", city=request["city"], max_price=0),  # nothing listed, then a guess
                  call("book_room", room_id=right["room_id"])]) == 0.2
    assert score([call("search_rooms", city=request["city"]), call("book_room", room_id=right["room_id"])]) == 1.0
    any_call = HotelEnv()  # the default: any well-formed call
    assert any_call.score_episode(None, tokenizer, play(any_call, request, [call("book_room", room_id="XYZ-999")]),
                                  request=request) == 0.1
    with pytest.raises(ValueError, match="format_credit='searches'"):
        HotelEnv(format_credit="searches")


def test_hotel_shuffle_results_orders_a_search_by_the_call_written(tokenizer):
    """env.shuffle_results=true: the same rooms, in an order that follows the exact call (so a greedy episode sees
    one order every time) and differs between calls written differently; the default keeps the fixed order."""
    plain, shuffled = HotelEnv(), HotelEnv(shuffle_results=True)
    request = next(r for r in shuffled.build_dataset(tokenizer)["request"]
                   if len(shuffled.search_rooms(r["city"], r["guests"], r["max_price"])) >= 3)
    ids = lambda env, text: [line.split(":")[0] for line in play(env, request, [text])[1]["content"].splitlines()]  # noqa: E731
    fixed = [r["room_id"] for r in plain.search_rooms(request["city"], request["guests"], request["max_price"])]
    calls = [call("search_rooms", city=request["city"], guests=request["guests"], max_price=request["max_price"])
             + " " * n for n in range(8)]  # eight ways of writing the same search
    assert all(ids(plain, c) == fixed for c in calls)
    orders = [ids(shuffled, c) for c in calls]
    assert all(sorted(o) == sorted(fixed) for o in orders)  # the same rooms
    assert orders == [ids(shuffled, c) for c in calls]  # the same call, the same order
    assert len({o[0] for o in orders}) > 1  # another way of writing it, another room first
    # the booking of any room the search listed is scored as before
    room = matching_room(shuffled, request)
    transcript = play(shuffled, request, [calls[0], call("book_room", room_id=room["room_id"])])
    assert shuffled.score_episode(None, tokenizer, transcript, request=request) == 1.0


def test_hotel_listing_hint_ends_each_listing_and_lists_no_room(tokenizer):
    """env.listing_hint=true: a search's listing (the worked example's too) ends with a line telling how to book;
    the rooms listed, and the scores, are what they are without it."""
    plain, hinted = HotelEnv(), HotelEnv(listing_hint=True)
    request = hinted.build_dataset(tokenizer)[0]["request"]
    search = call("search_rooms", city=request["city"], guests=request["guests"], max_price=request["max_price"])
    listing = play(hinted, request, [search])[1]["content"]
    assert listing == play(plain, request, [search])[1]["content"] + "\n" + LISTING_HINT
    assert listed_ids(listing) == listed_ids(play(plain, request, [search])[1]["content"]) != []
    room = matching_room(hinted, request)
    transcript = play(hinted, request, [search, call("book_room", room_id=room["room_id"])])
    assert hinted.score_episode(None, tokenizer, transcript, request=request) == 1.0
    example_listing = hinted._worked_example()[2]["content"]
    assert example_listing.startswith("POR-101: ") and example_listing.endswith("\n" + LISTING_HINT)
    nowhere = call("search_rooms", city="Atlantis")
    assert play(hinted, request, [nowhere])[1]["content"] == "no rooms match"  # no rooms, no hint


def test_hotel_booking_starts_add_rows_that_open_at_the_booking_turn(tokenizer):
    """env.booking_starts: extra training rows whose opening already holds the right search and its listing (two
    rooms or more), so the assistant's first turn is the booking; scored as the same booking after that search in a
    full episode; the held-out test requests stay the same, and no test request's booking start is trained on."""
    from grpo_pipeline.config.schema import EvalConfig
    from grpo_pipeline.envs.hotel import HotelSeedEnv
    from grpo_pipeline.evaluation.heldout import split_heldout

    kwargs = {"shuffle_results": True, "listing_hint": True}
    plain, env = HotelEnv(**kwargs), HotelEnv(booking_starts=1.0, **kwargs)
    full, both = plain.build_dataset(tokenizer), env.build_dataset(tokenizer)
    starts = [row for row in both if row["starts_at"] == "booking"]
    assert both.select(range(len(full)))["prompt"] == full["prompt"]  # the full rows first, unchanged
    assert set(both["starts_at"][:len(full)]) == {"request"} and len(starts) == len(both) - len(full) > 20
    row = starts[0]
    request, opening = row["request"], row["prompt"]
    search = call("search_rooms", city=request["city"], guests=request["guests"], max_price=request["max_price"])
    assert opening[:-2] == full[0]["prompt"][:-1] + [opening[-3]] and opening[-3]["role"] == "user"
    assert opening[-2] == {"role": "assistant", "content": search}
    assert opening[-1] == play(env, request, [search])[1]  # the env's own listing for that call, in its order
    listed = [env.rooms[i] for i in listed_ids(opening[-1]["content"])]
    assert len(listed) >= 2 and all(len(listed_ids(r["prompt"][-1]["content"])) >= 2 for r in starts)
    for room in listed:
        booking = [{"role": "assistant", "content": call("book_room", room_id=room["room_id"])}]
        in_full = play(env, request, [search, booking[0]["content"]])
        score = env.score_episode(None, tokenizer, booking, request=request, starts_at="booking")
        assert score == env.score_episode(None, tokenizer, in_full, request=request)
        assert score == (1.0 if env.fits(room, request) else pytest.approx(0.3 + 0.6 * 3 / 4))
    unlisted = next(i for i in env.rooms if i not in listed_ids(opening[-1]["content"]))
    assert env.score_episode(None, tokenizer, [{"role": "assistant", "content": call("book_room", room_id=unlisted)}],
                             request=request, starts_at="booking") == 0.2  # the search was right; the room unseen
    seed_style = HotelSeedEnv(booking_starts=1.0, **kwargs)  # the documents' way scores it the same
    assert seed_style.score_episode(None, tokenizer, call("book_room", room_id=listed[0]["room_id"]), request=request,
                                    starts_at="booking") == env.score_episode(
        None, tokenizer, [{"role": "assistant", "content": call("book_room", room_id=listed[0]["room_id"])}],
        request=request, starts_at="booking")
    split = lambda e, ds: split_heldout(ds, EvalConfig(), "hotel", e.heldout_group_by)  # noqa: E731
    test, trained = split(env, both).test, split(env, both).train
    assert test["prompt"] == split(plain, full).test["prompt"] and set(test["starts_at"]) == {"request"}
    assert not {json.dumps(r, sort_keys=True) for r in test["request"]} & {
        json.dumps(r["request"], sort_keys=True) for r in trained}
    with pytest.raises(ValueError, match="booking_starts"):
        HotelEnv(booking_starts=1.5)


def test_parse_tool_calls():
    assert parse_tool_calls('<tool_call>{"name": "x", "arguments": {"a": 1}}</tool_call>') == [
        {"name": "x", "arguments": {"a": 1}}
    ]
    assert parse_tool_calls("<tool_call>{not json}</tool_call>") is None
    assert parse_tool_calls("no calls") == []


def test_hotel_tools_and_template(tokenizer):
    env = HotelEnv()
    names = [t["function"]["name"] for t in env.get_tools()]
    assert names == ["search_rooms", "book_room"]
    assert supports_tools(tokenizer)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tools=env.get_tools(), add_generation_prompt=True, tokenize=False
    )
    assert '"name": "book_room"' in text and text.endswith("<|im_start|>assistant\n")


def test_shipped_code_never_evals_model_output():
    src = Path(__file__).resolve().parents[1] / "src" / "grpo_pipeline"
    for path in src.rglob("*.py"):
        code = path.read_text()
        assert not re.search(r"(?<![\w.])(eval|exec)\(", code), f"{path} calls eval/exec"


def test_tool_schemas_reach_text_prompts_and_templates_without_tools(tokenizer, caplog):
    """get_tools() is never dropped: the template renders it where it can (chat prompts on a template with tools),
    otherwise a plain tools preamble is written into every prompt; the log says which."""
    from datasets import Dataset

    from grpo_pipeline.prompts import place_tools

    tools = HotelEnv().get_tools()
    text = Dataset.from_list([{"prompt": "Book me a room in Lisbon.", "want": "x"}])
    with caplog.at_level("WARNING"):
        out = place_tools(text, tokenizer, tools, "TextEnv")
    prompt = out[0]["prompt"]
    assert prompt.startswith("# Tools") and prompt.endswith("\n\nBook me a room in Lisbon.")
    assert '"name": "book_room"' in prompt and "<tool_call>" in prompt and out[0]["want"] == "x"
    assert "TextEnv.get_tools(): 2 schema(s) written into every prompt as a tools preamble (the prompts are text)" \
        in caplog.text

    chat = Dataset.from_list([{"prompt": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Book."}]}])
    assert place_tools(chat, tokenizer, tools, "ChatEnv")[0]["prompt"] == chat[0]["prompt"]  # the template's job
    plain = build_tiny_tokenizer()
    plain.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    caplog.clear()
    with caplog.at_level("WARNING"):
        system = place_tools(chat, plain, tools, "ChatEnv")[0]["prompt"]
    assert system[0]["role"] == "system" and system[0]["content"].startswith("# Tools")
    assert system[0]["content"].endswith("\n\nBe brief.") and system[1:] == chat[0]["prompt"][1:]
    assert "the model's chat template does not render tools" in caplog.text
    no_system = Dataset.from_list([{"prompt": [{"role": "user", "content": "Book."}]}])
    added = place_tools(no_system, plain, tools, "ChatEnv")[0]["prompt"]
    assert [m["role"] for m in added] == ["system", "user"]
    assert place_tools(chat, plain, tools, "HotelEnv", described=True)[0]["prompt"] == chat[0]["prompt"]


def test_a_text_prompt_env_shows_the_model_its_tools_in_training(compose_cfg, tmp_path, monkeypatch):
    from grpo_pipeline.recipe import load_env_and_dataset

    monkeypatch.chdir(tmp_path)
    (tmp_path / "text_tools.py").write_text(
        "from datasets import Dataset\n"
        "class TextTools:\n"
        "    def build_dataset(self, tokenizer):\n"
        "        return Dataset.from_list([{'prompt': f'Find room {i}'} for i in range(4)])\n"
        "    def score_episode(self, model, tokenizer, completion):\n        return 0.5\n"
        "    def get_tools(self):\n"
        "        return [{'type': 'function', 'function': {'name': 'search_rooms', 'description': 'd',\n"
        "                 'parameters': {'type': 'object', 'properties': {}}}}]\n")
    cfg = compose_cfg(["model=tiny", "env=custom", "env._target_=text_tools.TextTools", f"output_dir={tmp_path}"])
    _, _, dataset, _ = load_env_and_dataset(cfg, None, str(tmp_path), render_tools=False)
    assert all(p.startswith("# Tools") and '"name": "search_rooms"' in p for p in dataset["prompt"])


def test_hotel_shuffle_per_episode_gives_each_training_episode_its_own_order():
    from grpo_pipeline.envs.hotel import right_search

    per_call = HotelEnv(shuffle_results=True)
    per_episode = HotelEnv(shuffle_results=True, shuffle_per_episode=True)
    rows = per_call.build_dataset(None)
    # a request whose right search lists 3+ rooms: its orders can differ
    request = next(r["request"] for r in rows
                   if len(per_call.search_rooms(**{k: r["request"][k] for k in ("city", "guests", "max_price")})) >= 3)
    search = [{"role": "assistant", "content": right_search(request)}]

    def order(env, seed=None):
        return listed_ids(env.respond(search, request, episode_seed=seed)["content"])

    assert order(per_episode) == order(per_call) == order(per_call, 5)  # held out (None): the call's order, as before
    orders = {tuple(order(per_episode, seed)) for seed in range(12)}
    assert len(orders) > 1 and {frozenset(o) for o in orders} == {frozenset(order(per_call))}  # same rooms
    assert order(per_episode, 3) == order(per_episode, 3)  # one episode: one order
    with pytest.raises(ValueError, match="shuffle_results=true"):
        HotelEnv(shuffle_per_episode=True)
