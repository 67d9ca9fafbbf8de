"""Multi-turn episodes the runtime generates: token fidelity (the tokens trained are the tokens sampled), the
env's tokens masked out of the loss, every assistant turn trained, budgets, failures, the hotel env."""

import json
import random

import pytest
import torch
from datasets import Dataset

import grpo_pipeline.recipe as recipe
from conftest import tiny_overrides
from grpo_pipeline.config.schema import ModelConfig, RuntimeConfig
from grpo_pipeline.envs.hotel import HotelEnv
from grpo_pipeline.envs.runner import GREEDY, EpisodeRunner
from grpo_pipeline.models import build_tiny_model, build_tiny_tokenizer
from grpo_pipeline.rollout.turns import Rollout, SharedPrefix, generate

SAMPLING = {"do_sample": True, "temperature": 0.9, "top_k": 0, "top_p": 1.0}


class ToolEnv:
    """Answers every assistant turn with a tool result until the third turn."""

    max_turns = 3
    turn_max_new_tokens = 6

    def __init__(self, fail_on: int | None = None):
        self.fail_on = fail_on

    def build_dataset(self, tokenizer):
        system = {"role": "system", "content": "You are a counting assistant. " * 4}
        return Dataset.from_list([{"prompt": [system, {"role": "user", "content": f"Count to {i}"}], "i": i}
                                  for i in range(24)])

    def respond(self, messages, i):
        if i == self.fail_on:
            raise ConnectionError("tool server down")
        turns = sum(m["role"] == "assistant" for m in messages)
        return {"role": "tool", "content": f"result {turns} for {i}"}

    def score_episode(self, model, tokenizer, completion, i):
        return (sum(len(m["content"]) for m in completion if m["role"] == "assistant") % 5) / 4


@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_tiny_tokenizer()
    tokenizer.padding_side = "left"
    return tokenizer, build_tiny_model(ModelConfig(name="tiny", source="tiny"), tokenizer)


def _rollout(tiny, env=None, **kw):
    tokenizer, model = tiny
    env = env or ToolEnv()
    runner = EpisodeRunner(env, tokenizer, RuntimeConfig(), ["i"])
    runner.bind(model)
    args = {"max_turns": env.max_turns, "turn_tokens": env.turn_max_new_tokens, "max_episode_tokens": 512} | kw
    return Rollout(env, tokenizer, runner, **args), env.build_dataset(tokenizer)


def _teacher_forced_logps(model, prompt_ids, completion_ids, temperature):
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion_ids)[:, None]).squeeze(-1)


def test_the_tokens_trained_are_the_tokens_sampled(tiny):
    rollout, data = _rollout(tiny)
    torch.manual_seed(0)
    trajs = rollout.run(tiny[1], data["prompt"][:4], [{"i": i} for i in range(4)], SAMPLING)
    for t in trajs:
        assert len(t.completion_ids) == len(t.env_mask) == len(t.logprobs)
        assert t.turns == 3 and sum(m["role"] == "tool" for m in t.messages) == 2
        # the model's own log-probabilities of exactly these tokens, in exactly this context, are the ones sampled
        forced = _teacher_forced_logps(tiny[1], t.prompt_ids, t.completion_ids, SAMPLING["temperature"])
        sampled = torch.tensor(t.logprobs)
        model_tokens = torch.tensor(t.env_mask).bool()
        assert torch.allclose(forced[model_tokens], sampled[model_tokens], atol=1e-4)
        # each assistant message is the decoding of its own sampled tokens, nothing re-encoded in between
        segments, current = [], []
        for tok, m in zip(t.completion_ids, t.env_mask, strict=True):
            if m:
                current.append(tok)
            elif current:
                segments, current = segments + [current], []
        segments += [current] if current else []
        texts = [rollout.tokenizer.decode(s, skip_special_tokens=True) for s in segments]
        assert texts == [m["content"] for m in t.messages if m["role"] == "assistant"]


def test_the_env_turns_are_masked_and_rendered_by_the_chat_template(tiny):
    rollout, data = _rollout(tiny)
    t = rollout.run(tiny[1], data["prompt"][:1], [{"i": 0}], GREEDY)[0]
    env_ids = [tok for tok, m in zip(t.completion_ids, t.env_mask, strict=True) if not m]
    env_text = rollout.tokenizer.decode(env_ids)
    assert "<|im_start|>tool\nresult 1 for 0<|im_end|>" in env_text and env_text.endswith("<|im_start|>assistant\n")
    assert t.env_tokens == len(env_ids) and set(t.logprobs[i] for i, m in enumerate(t.env_mask) if not m) == {0.0}


def test_a_shared_prefix_cache_gives_the_same_tokens(tiny):
    tokenizer, model = tiny
    base = tokenizer("<|im_start|>system\n" + "You are a counting assistant. " * 6, add_special_tokens=False)["input_ids"]
    sequences = [base + tokenizer(f"Count to {i}" * (i + 1), add_special_tokens=False)["input_ids"] for i in range(3)]
    prefix = SharedPrefix.build(model, sequences)
    assert prefix is not None and len(prefix.ids) >= len(base) - 1
    eos = [tokenizer.eos_token_id]
    with torch.no_grad():
        cached, _ = generate(model, sequences, 8, GREEDY, eos, tokenizer.pad_token_id, prefix, with_logprobs=False)
        plain, _ = generate(model, sequences, 8, GREEDY, eos, tokenizer.pad_token_id, None, with_logprobs=False)
        alone = [generate(model, [s], 8, GREEDY, eos, tokenizer.pad_token_id, None, with_logprobs=False)[0][0]
                 for s in sequences]
    assert cached == plain == alone


def test_each_turn_continues_from_the_episodes_kv_cache(tiny, monkeypatch):
    """Turn k+1 feeds only what turn k's cache lacks (its last token, the env's reply), and gives the tokens
    and log-probs a full prefill gives: also for rows that ended early (tokens sampled after their eos sit in
    the cache, masked) and rows cut by the turn limit."""
    import grpo_pipeline.rollout.turns as rollout_module

    fed = []
    decode = rollout_module.decode
    monkeypatch.setattr(rollout_module, "decode", lambda model, ids, mask, *a, **kw: (
        fed.append(ids.size(1) - a[4] if len(a) > 4 else ids.size(1)), decode(model, ids, mask, *a, **kw))[1])

    def episodes(reuse: bool, sampling, extra_eos=()):
        rollout, data = _rollout(tiny, reuse_cache=reuse, turn_tokens=8)
        rollout.eos_ids = rollout.eos_ids + list(extra_eos)
        torch.manual_seed(0)
        fed.clear()
        trajs = rollout.run(tiny[1], data["prompt"][:6], [{"i": i} for i in range(6)], sampling)
        return trajs, list(fed)

    plain, _ = episodes(False, GREEDY)
    common = max(set(plain[0].completion_ids), key=plain[0].completion_ids.count)  # ends some turns early
    plain, fed_plain = episodes(False, GREEDY, [common])
    reused, fed_reused = episodes(True, GREEDY, [common])
    turn_lengths = [len(m["content"]) for t in plain for m in t.messages if m["role"] == "assistant"]
    assert len(set(turn_lengths)) > 1  # turns of different lengths: early eos and full turns both happen
    assert [t.completion_ids for t in reused] == [t.completion_ids for t in plain]
    assert len(fed_reused) == len(fed_plain) == 3 and fed_reused[0] == fed_plain[0]
    assert max(fed_reused[1:]) < min(fed_plain[1:])  # later turns feed only the new tokens

    sampled, _ = episodes(True, SAMPLING, [common])
    for t in sampled:  # the sampled tokens' log-probs are the model's for exactly this context
        forced = _teacher_forced_logps(tiny[1], t.prompt_ids, t.completion_ids, SAMPLING["temperature"])
        model_tokens = torch.tensor(t.env_mask).bool()
        assert torch.allclose(forced[model_tokens], torch.tensor(t.logprobs)[model_tokens], atol=1e-4)


def test_the_token_budget_and_the_turn_limit_end_episodes(tiny):
    rollout, data = _rollout(tiny, max_episode_tokens=20)
    t = rollout.run(tiny[1], data["prompt"][:1], [{"i": 0}], GREEDY)[0]
    assert t.cut and len(t.completion_ids) <= 20 and t.turns < 3


def test_a_failing_respond_fails_its_own_episode_only(tiny):
    rollout, data = _rollout(tiny, env=ToolEnv(fail_on=1))
    trajs = rollout.run(tiny[1], data["prompt"][:3], [{"i": i} for i in range(3)], GREEDY)
    assert [t.failure is not None for t in trajs] == [False, True, False]
    assert "ToolEnv.respond raised" in trajs[1].failure and "tool server down" in trajs[1].failure
    assert trajs[0].turns == trajs[2].turns == 3 and trajs[1].turns == 1


def test_training_trains_every_assistant_turn_and_masks_the_env(compose_cfg, tmp_path, monkeypatch):
    from grpo_pipeline.training.trainer import PipelineTrainer

    seen = []
    original = PipelineTrainer._generate_and_score_completions

    def capture(self, inputs):
        out = original(self, inputs)
        seen.append(out)
        return out

    monkeypatch.setattr(PipelineTrainer, "_generate_and_score_completions", capture)
    cfg = compose_cfg([*tiny_overrides(tmp_path, ["env=custom", "env._target_=unused.Env"]), "loss=grpo",
                       "eval.enabled=true", "eval.num_prompts=4"])
    result = recipe.train(cfg, launch_dir=str(tmp_path), env=ToolEnv())
    assert result.steps == 2 and result.eval_after["num_prompts"] == 4
    mask = seen[0]["tool_mask"] * seen[0]["completion_mask"]
    for row in mask.tolist():  # model tokens (1), then env tokens (0), then model tokens again: turn 2 is trained
        text = "".join(map(str, row)).rstrip("0")
        assert "10" in text and "01" in text
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    metrics = client.get_run(result.mlflow_run_id).data.metrics
    assert metrics["env/turns_mean"] == 3 and metrics["env/env_tokens_mean"] > 0
    # the episode ledger has every turn of every training and held-out episode
    from grpo_pipeline.tracking.ledger import read

    entries = read(tmp_path / "run" / "episodes.jsonl")
    train = [e for e in entries if e["split"] == "train"]
    assert len(train) == 8 and {e["step"] for e in train} == {1, 2}
    assert all([m["role"] for m in e["messages"]].count("assistant") == 3 for e in train)
    assert all("[tool]" in e["completion"] or "[user]" in e["completion"] for e in train)
    assert sum(e["split"] == "test_after" for e in entries) == 4


def test_hotel_respond_runs_tools_and_scores_the_transcript():
    env = HotelEnv()
    request = env.build_dataset(build_tiny_tokenizer())[0]["request"]
    args = {k: request[k] for k in ("city", "guests", "max_price")}
    search = f'<tool_call>{json.dumps({"name": "search_rooms", "arguments": args})}</tool_call>'
    reply = env.respond([{"role": "assistant", "content": search}], request)
    listed = [line.split(":")[0] for line in reply["content"].splitlines()]
    found = [env.rooms[room_id] for room_id in listed]
    assert reply["role"] == "tool" and found and all(r["city"] == request["city"] for r in found)
    assert reply["content"].splitlines()[0] == f"{found[0]['room_id']}: {found[0]['capacity']} guests, " \
        f"{found[0]['price']} EUR, {', '.join(found[0]['features']) or 'no extras'}"
    best = next(r for r in found if env.wishes_met(r, request)[0] == env.wishes_met(r, request)[1])
    book = f'<tool_call>{json.dumps({"name": "book_room", "arguments": {"room_id": best["room_id"]}})}</tool_call>'
    assert env.respond([{"role": "assistant", "content": book}], request) is None  # booked: done
    transcript = [{"role": "assistant", "content": search}, reply, {"role": "assistant", "content": book}]
    assert env.score_episode(None, None, transcript, request) == 1.0
    assert env.score_episode(None, None, transcript[:2], request) == 0.2  # searched, never booked
    assert env.respond([{"role": "assistant", "content": "<tool_call>{oops</tool_call>"}], request)["role"] == "user"
    assert env.episode_metrics(transcript, request) == {"tool_calls": 2.0, "malformed_tool_calls": 0.0}


@pytest.mark.parametrize("ask_to_search", [False, True])
def test_hotel_score_turn_credits_only_this_episodes_search_and_listed_booking(ask_to_search):
    # the runtime passes the whole conversation: the opening's worked example (a Porto search listing POR-101, then
    # its booking) comes first and must earn nothing, or copying its booking without searching pays every turn;
    # env.ask_to_search=true ends each request (the example's too) with the nudge, and the episode is still found
    env = HotelEnv(ask_to_search=ask_to_search)
    request = next(r["request"] for r in env.build_dataset(build_tiny_tokenizer()) if r["request"]["city"] == "Porto")
    opening = env._opening(request)
    asks = [m["content"] for m in opening if m["role"] == "user"]
    assert len(asks) == 2 and all(a.endswith("Please search for rooms and book one that meets all my wishes.")
                                  == ask_to_search for a in asks)
    assert any(m["role"] == "tool" and "POR-101" in m["content"] for m in opening)  # what the example shows
    args = {k: request[k] for k in ("city", "guests", "max_price")}
    search = {"role": "assistant", "content": f'<tool_call>{json.dumps({"name": "search_rooms", "arguments": args})}</tool_call>'}

    def book(room_id):
        return {"role": "assistant", "content": f'<tool_call>{json.dumps({"name": "book_room", "arguments": {"room_id": room_id}})}</tool_call>'}

    assert env.score_turn([*opening, book("POR-101")], request) == 0.0  # the example's room, never searched for
    assert env.score_turn([*opening, search], request) == 0.1  # the episode's first search in the guest's city
    reply = env.respond([search], request)
    listed = reply["content"].splitlines()[0].split(":")[0]
    assert env.score_turn([*opening, search, reply, book(listed)], request) == 0.1  # a room its own search listed
    assert env.score_turn([*opening, search, reply, search], request) == 0.0  # a second search earns nothing
    unlisted = next(i for i in env.rooms if i.startswith("POR") and i not in reply["content"])
    assert env.score_turn([*opening, search, reply, book(unlisted)], request) == 0.0


def test_a_multi_turn_run_resumes_from_its_checkpoint(compose_cfg, tmp_path):
    overrides = [*tiny_overrides(tmp_path, ["env=custom", "env._target_=unused.Env"]), "training.save_steps=1"]
    first = recipe.train(compose_cfg([*overrides, "training.max_steps=1"]), launch_dir=str(tmp_path), env=ToolEnv())
    assert first.steps == 1 and (tmp_path / "run" / "checkpoints" / "checkpoint-1").is_dir()
    cfg = compose_cfg([*overrides, "training.max_steps=3", f"resume={tmp_path / 'run'}"])
    resumed = recipe.train(cfg, launch_dir=str(tmp_path), env=ToolEnv())
    assert resumed.steps == 3 and resumed.mlflow_run_id == first.mlflow_run_id
    from mlflow.tracking import MlflowClient

    from grpo_pipeline.tracking.ledger import read

    history = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_metric_history(resumed.mlflow_run_id,
                                                                                     "env/turns_mean")
    assert sorted(m.step for m in history) == [1, 2, 3]  # every step once, the resumed ones multi-turn too
    steps = [e["step"] for e in read(tmp_path / "run" / "episodes.jsonl") if e["split"] == "train"]
    assert sorted(set(steps)) == [1, 2, 3] and all(steps.count(s) == 4 for s in (1, 2, 3))


@pytest.mark.slow  # ~15-20 s of subprocess launches; its behaviour's core is covered in the default suite
def test_a_multirun_sweep_over_the_hotel_env(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "grpo_pipeline", "-m", "model=tiny", "env=hotel", "env.num_samples=24",
         "env.turn_max_new_tokens=6", "training.max_steps=1", "training.batch_size=4", "generation.num_generations=2",
         "eval.enabled=false", "loss.kl_coef=0,0.1", f"hydra.sweep.dir={tmp_path / 'sweep'}",
         f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("grpo_pipeline").experiment_id])
    jobs = [r for r in runs if r.data.params.get("env._target_") == "grpo_pipeline.envs.hotel.HotelEnv"]
    assert len(jobs) == 2 and {r.data.params["loss.kl_coef"] for r in jobs} == {"0.0", "0.1"}
    assert all(r.info.status == "FINISHED" and r.data.metrics["env/turns_mean"] >= 1 for r in jobs)


def test_an_episode_longer_than_vllm_max_model_len_is_refused_before_the_run(tiny, compose_cfg, tmp_path):
    from grpo_pipeline.errors import ConfigError

    rollout, data = _rollout(tiny, max_episode_tokens=100)
    lengths = [len(rollout._start(p, {}).prompt_ids) for p in data["prompt"]]
    i, prompt_tokens, tokens = rollout.longest_episode(data["prompt"])
    assert prompt_tokens == max(lengths) == lengths[i] and tokens == prompt_tokens + 100
    cfg = compose_cfg(["vllm=colocate", f"vllm.max_model_len={tokens}", f"output_dir={tmp_path}"])
    recipe._check_fits_vllm(cfg, rollout, data, "ToolEnv")  # fits exactly
    cfg.vllm.max_model_len = tokens - 1
    with pytest.raises(ConfigError, match=rf"vllm.max_model_len={tokens - 1} is too short for ToolEnv: dataset row "
                                          rf"{i} has a {prompt_tokens}-token prompt, and with "
                                          rf"runtime.max_episode_tokens=100 its episode can reach {tokens} tokens"):
        recipe._check_fits_vllm(cfg, rollout, data, "ToolEnv")


class SeededToolEnv(ToolEnv):
    """ToolEnv whose respond and score_episode take the runtime's `episode_seed`, and record what they got."""

    def __init__(self):
        super().__init__()
        self.responded, self.scored = [], []

    def respond(self, messages, i, episode_seed=None):
        self.responded.append(episode_seed)
        return {"role": "tool", "content": f"result for {i} seed {episode_seed}"}

    def score_episode(self, model, tokenizer, completion, i, episode_seed=None):
        self.scored.append((episode_seed, [m["content"] for m in completion if m["role"] == "tool"]))
        return 0.5


def test_each_training_episode_gets_its_own_seed_and_held_out_ones_none(compose_cfg, tmp_path):
    # an env method that declares episode_seed gets, in training, one seed per episode (the same in every call of
    # that episode: respond and score_episode), a different one for each episode of a group; held out, None
    env = SeededToolEnv()
    cfg = compose_cfg([*tiny_overrides(tmp_path, ["env=custom", "env._target_=unused.Env"]), "eval.enabled=true",
                       "eval.num_prompts=4"])
    recipe.train(cfg, launch_dir=str(tmp_path), env=env)
    train = [(seed, tools) for seed, tools in env.scored if seed is not None]
    held_out = [(seed, tools) for seed, tools in env.scored if seed is None]
    assert len(train) == 8 and len({seed for seed, _ in train}) == 8  # 2 steps x 4 episodes, all different
    stream = random.Random(f"{cfg.seed}|0")  # the run's seed and this process's rank: a rerun draws the same
    assert {seed for seed, _ in train} == {stream.getrandbits(31) for _ in range(8)}
    assert all(isinstance(seed, int) for seed, _ in train)
    for seed, tools in train:  # both env turns of the episode answered with the episode's own seed
        assert tools == [tools[0]] * 2 and tools[0].endswith(f"seed {seed}")
    assert len(held_out) == 8 and all(t[0].endswith("seed None") for _, t in held_out)  # 4 before, 4 after
    assert sorted(s for s in env.responded if s is not None) == sorted(2 * [seed for seed, _ in train])


def test_episode_seeds_follow_the_run_seed_and_reach_a_seed_style_env(tiny):
    tokenizer, model = tiny

    class SeedStyle:
        def __init__(self):
            self.got = []

        def score_episode(self, model, tokenizer, completion, i, episode_seed=None):
            self.got.append(episode_seed)
            return 0.0

    def draws(seed):
        return EpisodeRunner(SeededToolEnv(), tokenizer, RuntimeConfig(), ["i"], seed=seed).draw_episode_seeds(4)

    assert draws(7) == draws(7) != draws(8) and len(set(draws(7))) == 4
    assert EpisodeRunner(ToolEnv(), tokenizer, RuntimeConfig(), ["i"], seed=7).draw_episode_seeds(2) == [None, None]
    env = SeedStyle()
    runner = EpisodeRunner(env, tokenizer, RuntimeConfig(train_env_calls=False), ["i"], sampling=SAMPLING, seed=3)
    runner.bind(model)
    runner.score(["a", "b", "c"], [{"i": 0}, {"i": 1}, {"i": 2}])
    trained, env.got = env.got, []
    runner.score(["a", "b"], [{"i": 0}, {"i": 1}], evaluation=True)
    assert len(set(trained)) == 3 and all(isinstance(s, int) for s in trained) and env.got == [None, None]
