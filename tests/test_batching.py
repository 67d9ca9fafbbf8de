"""Concurrent episodes' model.generate calls are merged, and each caller gets what its own call returns."""

import threading
import time

import pytest
import torch

from grpo_pipeline.config.schema import ModelConfig, RuntimeConfig
from grpo_pipeline.envs.batching import GenerateBatcher
from grpo_pipeline.envs.runner import EpisodeRunner
from grpo_pipeline.errors import EnvError
from grpo_pipeline.models import build_tiny_tokenizer, load_model

WAIT = 60  # seconds: generous bounds for conditions that hold within milliseconds on an idle machine


@pytest.fixture(scope="module")
def tiny():
    tok = build_tiny_tokenizer()
    tok.padding_side = "left"
    model = load_model(ModelConfig(name="tiny", source="tiny"), tok).eval()
    return model, tok


PROMPTS = ["What is 12 + 34?", "hi", "search_rooms city Lisbon price 100 and a balcony please", "7 + 8 =",
           "book_room", "You are a helpful assistant. Solve the problem."]


def test_batched_results_equal_single_calls(tiny):
    model, tok = tiny
    calls = [(tok(p, return_tensors="pt"), 3 + 2 * i) for i, p in enumerate(PROMPTS)]
    with torch.no_grad():
        expected = [model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
                    for enc, n in calls]

    batcher = GenerateBatcher(model, tok.pad_token_id, tok.eos_token_id, max_wait_s=5.0)
    results = [None] * len(calls)

    def episode(i):
        enc, n = calls[i]
        results[i] = batcher.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
        batcher.episode_ended()

    for _ in calls:
        batcher.episode_started()
    threads = [threading.Thread(target=episode, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    batcher.close()
    for got, want in zip(results, expected, strict=True):
        assert got.shape == want.shape
        assert torch.equal(got, want)
    assert batcher.calls == len(calls) and batcher.batches == 1  # all six ran as one generate


def test_calls_with_different_sampling_are_not_merged(tiny):
    model, tok = tiny
    batcher = GenerateBatcher(model, tok.pad_token_id, tok.eos_token_id, max_wait_s=0.05)
    out = {}

    def episode(name, **kw):
        batcher.episode_started()
        out[name] = batcher.generate(**tok("hi", return_tensors="pt"), max_new_tokens=4,
                                     pad_token_id=tok.pad_token_id, **kw)
        batcher.episode_ended()

    threads = [threading.Thread(target=episode, args=("greedy",), kwargs={"do_sample": False}),
               threading.Thread(target=episode, args=("sampled",), kwargs={"do_sample": True, "temperature": 0.7})]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    batcher.close()
    assert batcher.batches == 2 and set(out) == {"greedy", "sampled"}


def test_unmergeable_call_runs_directly(tiny):
    model, tok = tiny
    batcher = GenerateBatcher(model, tok.pad_token_id, tok.eos_token_id)
    res = batcher.generate(**tok("hi", return_tensors="pt"), max_new_tokens=2, return_dict_in_generate=True,
                           pad_token_id=tok.pad_token_id)
    batcher.close()
    assert hasattr(res, "sequences") and batcher.batches == 0


class MultiTurnEnv:
    def __init__(self):
        self.shapes = []

    def score_episode(self, model, tokenizer, completion, turns=3):
        text = completion
        for _ in range(turns):
            enc = tokenizer(text, return_tensors="pt")
            out = model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
            self.shapes.append((enc["input_ids"].shape[1], out.shape[1]))
            text = tokenizer.decode(out[0], skip_special_tokens=True)
        return 1.0


def test_runner_batches_multi_turn_episodes(tiny):
    model, tok = tiny
    env = MultiTurnEnv()
    runner = EpisodeRunner(env, tok, RuntimeConfig(max_concurrency=8, batch_wait_ms=500), ["turns"])
    runner.bind(model)
    generate_calls = []
    original = model.generate
    model.generate = lambda *a, **k: generate_calls.append(1) or original(*a, **k)
    try:
        scores, _ = runner.score(PROMPTS[:4] * 2, [{"turns": 3}] * 8)
    finally:
        del model.generate
    assert scores == [1.0] * 8
    assert len(env.shapes) == 24 and all(0 < o - i <= 4 for i, o in env.shapes)
    assert len(generate_calls) < 24 / 2  # 8 episodes x 3 turns, merged


def run_concurrently(batcher: GenerateBatcher, calls: list[dict]) -> tuple[list, list]:
    """Each call's batcher.generate on its own thread, as concurrent episodes make them: results, errors."""
    results, errors = [None] * len(calls), [None] * len(calls)
    for _ in calls:
        batcher.episode_started()

    def episode(i):
        try:
            results[i] = batcher.generate(**calls[i])
        except Exception as e:
            errors[i] = e
        finally:
            batcher.episode_ended()

    threads = [threading.Thread(target=episode, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=WAIT)
    assert not any(t.is_alive() for t in threads)
    return results, errors


def ids(tok, *texts):
    return tok(list(texts), return_tensors="pt", padding=True)


def exactness_cases(tok) -> dict[str, list[dict]]:
    """Calls that each batch merges into one generate; greedy, so each result must equal the solo call's."""
    greedy = {"do_sample": False}
    lisbon = "search_rooms city Lisbon price 100 and a balcony please"
    assistant = "You are a helpful assistant."
    return {
        # their own eos (not the tokenizer's): "What is" ends at step 5, "book_room" at step 3, "hi" never
        "own_eos": [dict(input_ids=ids(tok, p)["input_ids"], max_new_tokens=12, eos_token_id=101, **greedy)
                    for p in ("What is 12 + 34?", "book_room", "hi")],
        "own_eos_list": [dict(input_ids=ids(tok, p)["input_ids"], max_new_tokens=12, eos_token_id=[22, 101],
                              **greedy) for p in (assistant, "book_room", "7 + 8 =")],
        # pad != eos, no attention_mask: generate masks the pad id where the input has it (305 is in two prompts)
        "own_pad_no_mask": [dict(input_ids=ids(tok, p)["input_ids"], max_new_tokens=n, pad_token_id=305, **greedy)
                            for p, n in ((assistant, 6), (lisbon, 8), ("hi", 10))],
        # several rows per call, with and without a mask (padded with pad == eos: generate uses all ones)
        "several_rows": [dict(**ids(tok, "hi", "What is 12 + 34?"), max_new_tokens=5, **greedy),
                         dict(input_ids=ids(tok, "7 + 8 =", "book_room", lisbon)["input_ids"], max_new_tokens=9,
                              **greedy),
                         dict(**ids(tok, assistant), max_new_tokens=2, **greedy)],
    }


@pytest.mark.parametrize("case", ["own_eos", "own_eos_list", "own_pad_no_mask", "several_rows"])
def test_merged_calls_return_exactly_what_each_call_alone_returns(tiny, case):
    model, tok = tiny
    calls = exactness_cases(tok)[case]
    with torch.no_grad():
        expected = [model.generate(**call) for call in calls]
    batcher = GenerateBatcher(model, tok.pad_token_id, tok.eos_token_id, max_wait_s=WAIT)
    results, errors = run_concurrently(batcher, calls)
    batcher.close()
    assert errors == [None] * len(calls)
    assert batcher.batches == 1  # one merged generate for the whole case
    for got, want in zip(results, expected, strict=True):
        assert got.shape == want.shape and torch.equal(got, want), (got.tolist(), want.tolist())


def test_a_call_after_close_fails_at_once(tiny):
    model, tok = tiny
    batcher = GenerateBatcher(model, tok.pad_token_id, tok.eos_token_id)
    batcher.close()
    for extra in ({}, {"return_dict_in_generate": True}):  # merged and direct calls alike
        with pytest.raises(RuntimeError, match="GenerateBatcher is closed"):
            batcher.generate(**tok("hi", return_tensors="pt"), max_new_tokens=2, **extra)


class CountingModel(torch.nn.Module):
    """generate appends one token; cheap, so many threads race close()."""

    def generate(self, input_ids, attention_mask=None, max_new_tokens=1, **_):
        return torch.cat([input_ids, input_ids[:, -1:]], dim=1)


def test_close_racing_with_callers_never_leaves_one_waiting():
    batcher = GenerateBatcher(CountingModel(), 0, None, max_wait_s=0.0)
    outcomes = []
    started = threading.Barrier(9)

    def caller():
        started.wait(WAIT)
        while True:
            try:
                batcher.generate(torch.ones(1, 3, dtype=torch.long), max_new_tokens=1)
            except RuntimeError as e:
                outcomes.append(str(e))
                return

    threads = [threading.Thread(target=caller) for _ in range(8)]
    for t in threads:
        t.start()
    started.wait(WAIT)
    deadline = time.monotonic() + WAIT
    while batcher.calls < 50 and time.monotonic() < deadline:  # callers are going; close while they are mid-flight
        time.sleep(0.001)
    batcher.close()
    for t in threads:
        t.join(timeout=WAIT)
    assert not any(t.is_alive() for t in threads)
    assert len(outcomes) == 8 and all("GenerateBatcher is closed" in o for o in outcomes)


class TokenEnv:
    """Generates from the ids in its row; records what it got."""

    def __init__(self):
        self.outputs = {}

    def score_episode(self, model, tokenizer, completion, input_ids):
        out = model.generate(torch.tensor([input_ids]), max_new_tokens=6, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        self.outputs[completion] = out
        return 1.0


def test_one_bad_generate_call_fails_only_its_own_episode(tiny):
    model, tok = tiny
    good = [tok("What is 12 + 34?")["input_ids"], tok("book_room")["input_ids"]]
    bad = [5, len(tok) + 1000, 7]  # an id past the vocabulary: the embedding raises
    env = TokenEnv()
    runner = EpisodeRunner(env, tok, RuntimeConfig(batch_wait_ms=WAIT * 1000, on_error="raise"), ["input_ids"])
    runner.bind(model)
    generate_calls = []
    original = model.generate
    model.generate = lambda *a, **k: generate_calls.append(1) or original(*a, **k)
    try:
        with pytest.raises(EnvError) as e:
            runner.score(["a", "b", "c"], [{"input_ids": good[0]}, {"input_ids": bad}, {"input_ids": good[1]}])
    finally:
        del model.generate
    assert len(generate_calls) == 4  # the merged call failed; each call then ran alone
    assert "model.generate failed for episode 1 (row {'input_ids': [5, " in str(e.value)
    assert set(env.outputs) == {"a", "c"}
    with torch.no_grad():
        for name, row in (("a", good[0]), ("c", good[1])):
            want = model.generate(torch.tensor([row]), max_new_tokens=6, do_sample=False,
                                  pad_token_id=tok.pad_token_id)
            assert torch.equal(env.outputs[name], want)


def test_a_short_call_is_not_merged_behind_a_long_one_and_returns_first():
    finished = []

    class Recording(CountingModel):  # generate writes max_new_tokens tokens, "slowly"
        def generate(self, input_ids, attention_mask=None, max_new_tokens=1, **_):
            time.sleep(0.001 * max_new_tokens)
            finished.append(max_new_tokens)
            return torch.cat([input_ids, input_ids[:, -1:].repeat(1, max_new_tokens)], dim=1)

    batcher = GenerateBatcher(Recording(), 0, None, max_wait_s=5.0)
    calls = [dict(input_ids=torch.ones(1, 3, dtype=torch.long), max_new_tokens=n) for n in (2000, 4, 40, 6)]
    results, errors = run_concurrently(batcher, calls)
    batcher.close()
    assert errors == [None] * 4
    assert [r.shape[1] - 3 for r in results] == [2000, 4, 40, 6]
    # 4 and 6 merge (one generate of 6 tokens); 40 > max(2 x 4, 4 + 32) and 2000 run alone; shortest first
    assert finished == [6, 40, 2000] and batcher.batches == 3


def test_without_a_worker_the_waiting_thread_serves_and_a_late_worker_takes_over(tiny):
    """worker=False: the calls run on the thread that serves (here a ServingEvent's wait, as the runner's
    run_bounded does); calls left after it stopped serving run once a worker is started, and close() drains."""
    from grpo_pipeline.envs.batching import ServingEvent

    model, tok = tiny
    batcher = GenerateBatcher(model, tok.pad_token_id, tok.eos_token_id, max_wait_s=0.0, worker=False)
    ran_on = []
    generate = model.generate

    def recording(*a, **kw):
        ran_on.append(threading.current_thread())
        return generate(*a, **kw)

    model.generate = recording
    try:
        results, event = {}, ServingEvent(batcher)

        def caller(name):
            results[name] = batcher.generate(**tok("hi", return_tensors="pt"), max_new_tokens=2, do_sample=False,
                                             pad_token_id=tok.pad_token_id)
            event.set()

        first = threading.Thread(target=caller, args=("first",))
        first.start()
        assert event.wait(WAIT)  # served here, on this thread, until the caller got its result
        first.join(WAIT)
        assert results["first"].shape[1] == tok("hi", return_tensors="pt")["input_ids"].shape[1] + 2
        assert ran_on == [threading.current_thread()]
        late = threading.Thread(target=caller, args=("late",))
        late.start()  # nobody serves it yet: its call waits
        late.join(0.2)
        assert late.is_alive() and "late" not in results
        batcher.start_worker()
        late.join(WAIT)
        assert "late" in results and ran_on[-1] is batcher.worker
    finally:
        model.generate = generate
        batcher.close()
