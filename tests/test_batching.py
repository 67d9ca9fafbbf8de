"""Concurrent episodes' model.generate calls are merged, and each caller gets what its own call returns."""

import threading

import pytest
import torch

from grpo_pipeline.config.schema import ModelConfig, RuntimeConfig
from grpo_pipeline.models import build_tiny_tokenizer, load_model
from grpo_pipeline.runtime.batching import GenerateBatcher
from grpo_pipeline.runtime.episodes import EpisodeRunner


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
