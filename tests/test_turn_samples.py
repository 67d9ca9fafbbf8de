"""Seed-style envs (score_episode calls model.generate itself, the documents' way): in training, every turn they
sample with the run's settings is recorded and trained as a row of its own, with its episode's advantage."""

import functools
import json

import pytest
import torch
from datasets import Dataset

import grpo_pipeline.recipe as recipe
import grpo_pipeline.rollout.turns as turns_module
from conftest import scripted, tiny_overrides
from grpo_pipeline.config.schema import ModelConfig, RuntimeConfig
from grpo_pipeline.envs.hotel import HotelSeedEnv
from grpo_pipeline.envs.recorder import CallRecorder, TurnSample
from grpo_pipeline.envs.runner import EpisodeRunner
from grpo_pipeline.models import build_tiny_model, build_tiny_tokenizer
from grpo_pipeline.training.turn_samples import chained, turn_rows

SAMPLING = {"do_sample": True, "temperature": 0.9, "top_k": 0, "top_p": 1.0}


class SeedEnv:
    """The first reply comes from the trainer; the env asks again and generates the second turn itself."""

    def __init__(self, greedy: bool = False, whole_conversation: bool = False):
        self.greedy = greedy
        self.whole_conversation = whole_conversation  # the second turn's context starts with the opening
        self.calls: dict[int, tuple[list[int], list[int]]] = {}  # i -> (input ids, ids the env got back)

    def build_dataset(self, tokenizer):
        system = {"role": "system", "content": "You are a counting assistant. " * 4}
        return Dataset.from_list([{"prompt": [system, {"role": "user", "content": f"Count to {i}"}], "i": i}
                                  for i in range(24)])

    def score_episode(self, model, tokenizer, completion, i):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        messages = [{"role": "user", "content": f"Count to {i}"}, {"role": "assistant", "content": text},
                    {"role": "user", "content": "Again, please."}]
        if self.whole_conversation:
            messages.insert(0, {"role": "system", "content": "You are a counting assistant. " * 4})
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
        extra = {"do_sample": False} if self.greedy else {}
        out = model.generate(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                             max_new_tokens=6 + i % 3, **extra)
        width = inputs["input_ids"].shape[1]
        self.calls[i] = (inputs["input_ids"][0].tolist(), out[0, width:].tolist())
        second = tokenizer.decode(out[0, width:], skip_special_tokens=True)
        return ((len(text) + len(second)) % 5) / 4


@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_tiny_tokenizer()
    tokenizer.padding_side = "left"
    return tokenizer, build_tiny_model(ModelConfig(name="tiny", source="tiny"), tokenizer)


def _teacher_forced(model, prompt_ids, completion_ids, temperature):
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion_ids)[:, None]).squeeze(-1)


@pytest.mark.parametrize("batch_generate", [True, False])
def test_recorded_turns_are_the_tokens_sampled_with_their_log_probs(tiny, batch_generate):
    tokenizer, model = tiny
    env = SeedEnv()
    runner = EpisodeRunner(env, tokenizer, RuntimeConfig(batch_generate=batch_generate), ["i"], sampling=SAMPLING)
    runner.bind(model)
    recorders = [CallRecorder(SAMPLING) for _ in range(6)]
    torch.manual_seed(0)
    episodes = runner.run_episodes(["one two"] * 6, [{"i": i} for i in range(6)], recorders=recorders)
    assert all(ep.error is None for ep in episodes)
    eos = tokenizer.eos_token_id
    for i, rec in enumerate(recorders):
        assert rec.skipped == 0 and len(rec.samples) == 1
        sample = rec.samples[0]
        given, got = env.calls[i]
        assert sample.prompt_ids == given  # the context the env fed, without the batcher's padding
        end = got.index(eos) + 1 if eos in got else len(got)
        assert sample.completion_ids == got[:end] and sample.ended == (eos in got)  # what the env got back
        forced = _teacher_forced(model, sample.prompt_ids, sample.completion_ids, SAMPLING["temperature"])
        assert torch.allclose(forced, torch.tensor(sample.logprobs), atol=1e-4)


def test_in_training_recorded_calls_sample_from_the_rollouts_copy_with_its_decode_loop(tiny):
    from grpo_pipeline.rollout.turns import Rollout

    tokenizer, model = tiny
    env = SeedEnv()
    runner = EpisodeRunner(env, tokenizer, RuntimeConfig(), ["i"], sampling=SAMPLING)
    runner.bind(model)
    rollout = Rollout(env, tokenizer, runner, max_turns=1, turn_tokens=6, max_episode_tokens=6)
    used = []
    fast = rollout.sample_for_env
    runner.fast_generate = lambda *a: used.append(len(a[0])) or fast(*a)
    data = env.build_dataset(tokenizer)
    torch.manual_seed(0)
    trajs = rollout.run(model, data["prompt"][:4], [{"i": i} for i in range(4)], SAMPLING)  # the step's first turns
    recorders = [CallRecorder(SAMPLING) for _ in range(4)]
    episodes = runner.run_episodes([t.text for t in trajs], [{"i": i} for i in range(4)], recorders=recorders)
    assert all(ep.error is None for ep in episodes) and sum(used) == 4  # the 4 episodes' calls, by the decode loop
    for i, rec in enumerate(recorders):
        sample = rec.samples[0]
        given, got = env.calls[i]
        assert sample.prompt_ids == given and sample.completion_ids == got[: len(sample.completion_ids)]
        forced = _teacher_forced(model, sample.prompt_ids, sample.completion_ids, SAMPLING["temperature"])
        assert torch.allclose(forced, torch.tensor(sample.logprobs), atol=1e-4)


def test_calls_that_do_not_sample_as_the_run_are_counted_not_recorded(tiny):
    tokenizer, model = tiny
    runner = EpisodeRunner(SeedEnv(greedy=True), tokenizer, RuntimeConfig(), ["i"], sampling=SAMPLING)
    runner.bind(model)
    recorders = [CallRecorder(SAMPLING) for _ in range(3)]
    runner.run_episodes(["a", "b", "c"], [{"i": i} for i in range(3)], recorders=recorders)
    assert [len(r.samples) for r in recorders] == [0, 0, 0] and [r.skipped for r in recorders] == [1, 1, 1]
    own = CallRecorder(SAMPLING)
    ids = torch.tensor([[1, 2, 3]])
    assert not own.accepts((ids,), SAMPLING | {"temperature": 0.5})  # the env's own temperature
    assert not own.accepts((ids,), SAMPLING | {"logits_processor": []})
    assert own.accepts((ids,), SAMPLING | {"max_new_tokens": 4}) and own.skipped == 2


def test_a_call_whose_text_continues_the_episode_is_sampled_from_the_episodes_own_tokens():
    tokenizer = build_tiny_tokenizer()
    encode = functools.partial(tokenizer.encode, add_special_tokens=False)
    opening = encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    reply = [tokenizer.convert_tokens_to_ids(t) for t in ("h", "e", "y")] + encode("<|im_end|>")  # not canonical
    turn = "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    recorder = CallRecorder(SAMPLING, opening + reply, tokenizer)
    rendered = encode(tokenizer.decode(opening + reply) + turn)  # what an env re-rendering the chat gets
    assert rendered[: len(opening + reply)] != opening + reply
    sampled_from = recorder.rebased(rendered)
    assert sampled_from == opening + reply + encode(turn)
    assert tokenizer.decode(sampled_from) == tokenizer.decode(rendered)
    other = encode(tokenizer.decode(opening) + "hex<|im_end|>" + turn)  # another reply: left as it is
    assert recorder.rebased(other) == other and recorder.rebased(opening) == opening
    assert recorder.rebased_calls == 0  # counted when a row sampled from rebased tokens is recorded, not before
    # the call's sample extends the episode: the next call re-rendering the whole chat is rebased onto both
    second = [tokenizer.convert_tokens_to_ids(t) for t in ("h", "e")] + encode("<|im_end|>")
    recorder.add(torch.tensor([rendered]), torch.ones(1, len(rendered)), torch.tensor([second]),
                 torch.zeros(1, len(second)), encode("<|im_end|>"), prompts=[sampled_from])
    assert recorder.samples[0].prompt_ids == sampled_from and recorder.rebased_calls == 1
    third = encode(tokenizer.decode(sampled_from + second) + turn)
    assert recorder.rebased(third) == sampled_from + second + encode(turn)
    recorder.add(torch.tensor([third]), torch.ones(1, len(third)), torch.tensor([second]),
                 torch.zeros(1, len(second)), encode("<|im_end|>"), prompts=[third])  # sampled from its own input
    assert recorder.samples[1].prompt_ids == third and recorder.rebased_calls == 1
    assert CallRecorder(SAMPLING).rebased(third) == third  # no episode given: nothing to rebase onto


def test_turn_rows_lay_out_a_trl_batch_with_each_episodes_advantage():
    a = TurnSample([5, 6, 7], [8, 9], [-0.5, -0.25], ended=True)
    b = TurnSample([5], [8, 9, 10], [-1.0, -2.0, -3.0], ended=False)
    rows = turn_rows([[a, b], [], [a]], torch.tensor([0.5, -1.0, 2.0]), pad_id=0, mask_truncated=True)
    assert rows["prompt_ids"].tolist() == [[5, 6, 7], [0, 0, 5], [5, 6, 7]]  # left-padded, as TRL pads prompts
    assert rows["prompt_mask"].tolist() == [[1, 1, 1], [0, 0, 1], [1, 1, 1]]
    assert rows["completion_ids"].tolist() == [[8, 9, 0], [8, 9, 10], [8, 9, 0]]
    assert rows["completion_mask"].tolist() == [[1, 1, 0], [0, 0, 0], [1, 1, 0]]  # b was cut: masked (DAPO)
    assert rows["advantages"].tolist() == [0.5, 0.5, 2.0]  # each turn carries its own episode's advantage
    assert rows["sampling_per_token_logps"][1].tolist() == [-1.0, -2.0, -3.0]
    assert turn_rows([[], []], torch.tensor([1.0, 2.0]), pad_id=0) is None


def test_samples_that_continue_their_row_token_exactly_are_chained_onto_it():
    out = {"prompt_ids": torch.tensor([[0, 1, 2], [3, 4, 5]]), "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
           "completion_ids": torch.tensor([[6, 7, 0], [8, 0, 0]]), "completion_mask": torch.tensor([[1, 1, 0],
                                                                                               [1, 0, 0]]),
           "sampling_per_token_logps": torch.tensor([[-0.1, -0.2, 0.0], [-0.3, 0.0, 0.0]]),
           "advantages": torch.tensor([1.0, -1.0])}
    first = TurnSample([1, 2, 6, 7, 30, 31], [40, 41], [-1.0, -2.0], ended=True)  # the row so far + the env's 30 31
    second = TurnSample([1, 2, 6, 7, 30, 31, 40, 41, 32], [42], [-3.0], ended=True)  # and then the env's 32
    apart = TurnSample([3, 4, 9], [43], [-4.0], ended=True)  # not the row's context: a row of its own
    new, rest, grown = chained(out, [[first, second], [apart]], pad_id=0)
    assert grown == [0] and rest == [[], [apart]]
    assert new["completion_ids"][0].tolist() == [6, 7, 30, 31, 40, 41, 32, 42]
    assert new["completion_mask"][0].tolist() == [1] * 8 and new["completion_mask"][1].tolist() == [1] + [0] * 7
    assert new["tool_mask"][0].tolist() == [1, 1, 0, 0, 1, 1, 0, 1]  # the env's tokens are not trained
    assert new["sampling_per_token_logps"][0].tolist() == pytest.approx([-0.1, -0.2, 0, 0, -1, -2, 0, -3])
    assert new["completion_ids"][1].tolist() == [8] + [0] * 7 and torch.equal(new["advantages"], out["advantages"])
    # a truncated sample under mask_truncated is laid out but not trained; no sample chains: the batch as it was
    cut = TurnSample(first.prompt_ids, first.completion_ids, first.logprobs, ended=False)
    assert chained(out, [[cut], []], pad_id=0, mask_truncated=True)[0]["tool_mask"][0].tolist()[:6] == [1, 1, 0, 0,
                                                                                                          0, 0]
    # a reply masked whole (truncated, mask_truncated): still untrained, laid out as the context the turns chain onto
    masked = dict(out, completion_mask=torch.tensor([[0, 0, 0], [1, 0, 0]]))
    new, rest, grown = chained(masked, [[first, second], []], pad_id=0, mask_truncated=True)
    assert grown == [0] and rest == [[], []]
    assert new["completion_ids"][0].tolist() == [6, 7, 30, 31, 40, 41, 32, 42]
    assert new["completion_mask"][0].tolist() == [1] * 8 and new["tool_mask"][0].tolist() == [0, 0, 0, 0, 1, 1, 0, 1]
    same, rest, grown = chained(masked, [[apart], []], pad_id=0, mask_truncated=True)  # another prompt: apart
    assert same is masked and rest == [[apart], []]
    same, rest, grown = chained(out, [[apart], []], pad_id=0)
    assert same is out and grown == [] and rest == [[apart], []]
    # per-turn credit: the chained tokens carry their episode's advantage, the env's tokens too (masked anyway)
    turns = dict(out, turn_advantages=torch.tensor([[0.5, 1.5, 0.0], [-1.0, 0.0, 0.0]]))
    new = chained(turns, [[first, second], []], pad_id=0)[0]
    assert new["turn_advantages"][0].tolist() == [0.5, 1.5, 1, 1, 1, 1, 1, 1]
    assert new["turn_advantages"][1].tolist() == [-1.0] + [0.0] * 7
    # a sequence-level importance ratio (one per row) covers the first reply only: nothing is chained under it
    seq = dict(out, importance_sampling_ratio=torch.tensor([[0.9], [1.0]]))
    same, rest, grown = chained(seq, [[first, second], [apart]], pad_id=0)
    assert same is seq and grown == [] and rest == [[first, second], [apart]]
    token = dict(out, importance_sampling_ratio=torch.tensor([[0.9, 0.8, 1.0], [1.0, 1.0, 1.0]]))
    assert chained(token, [[first], []], pad_id=0)[0]["importance_sampling_ratio"][0].tolist() == pytest.approx(
        [0.9, 0.8, 1, 1, 1, 1])
    with pytest.raises(NotImplementedError, match="token_type_ids"):  # a tensor it cannot lay out is refused
        chained(dict(out, token_type_ids=torch.zeros(2, 3)), [[first], []], pad_id=0)


def _train(compose_cfg, tmp_path, monkeypatch, extra=(), env=None):
    """A 2-step tiny run of SeedEnv; returns (result, the batches TRL trained, the losses' inputs)."""
    from grpo_pipeline.training.trainer import PipelineTrainer

    batches, losses = [], []
    generate_and_score, compute_loss = PipelineTrainer._generate_and_score_completions, PipelineTrainer._compute_loss

    def capture_batch(self, inputs):
        out = generate_and_score(self, inputs)
        batches.append({k: v.clone() if torch.is_tensor(v) else v for k, v in out.items()})
        return out

    def capture_loss(self, model, inputs):
        losses.append((self, model, inputs))
        return compute_loss(self, model, inputs)

    monkeypatch.setattr(PipelineTrainer, "_generate_and_score_completions", capture_batch)
    monkeypatch.setattr(PipelineTrainer, "_compute_loss", capture_loss)
    cfg = compose_cfg([*tiny_overrides(tmp_path, ["env=custom", "env._target_=unused.Env"]), "loss=grpo", *extra])
    result = recipe.train(cfg, launch_dir=str(tmp_path), env=env or SeedEnv())
    return result, batches, losses, compute_loss


def _unpadded(ids, mask) -> tuple:
    return tuple(ids[mask.bool()].tolist())


def test_a_seed_style_envs_second_turn_is_trained(compose_cfg, tmp_path, monkeypatch):
    result, batches, losses, compute_loss = _train(compose_cfg, tmp_path, monkeypatch)
    assert result.steps == 2
    out = batches[0]
    n = 4  # training.batch_size episodes, then one row per turn the env sampled
    assert out["advantages"].size(0) == 2 * n
    assert torch.equal(out["advantages"][n:], out["advantages"][:n])  # each turn: its episode's advantage
    assert out["num_items_in_batch"].item() == (out["completion_mask"]).sum().item()
    turn_prompts = {_unpadded(out["prompt_ids"][r], out["prompt_mask"][r]) for r in range(n, 2 * n)}
    openings = {_unpadded(out["prompt_ids"][r], out["prompt_mask"][r]) for r in range(n)}
    assert turn_prompts and not turn_prompts & openings  # the contexts the env built for its second turn
    # in the step's real loss, the turn rows alone carry gradient: train only them (advantage 1, the episodes'
    # completions masked) and the adapter gets a gradient; mask them too and it gets none
    trainer, model, inputs = losses[0]
    is_turn = torch.tensor([_unpadded(inputs["prompt_ids"][r], inputs["prompt_mask"][r]) in turn_prompts
                            for r in range(inputs["advantages"].size(0))])
    assert is_turn.sum().item() == n
    params = [p for p in model.parameters() if p.requires_grad]

    def grad_norm(keep_turns: bool) -> float:
        batch = dict(inputs)
        batch["advantages"] = torch.where(is_turn, 1.0, 0.0)
        keep = is_turn[:, None] if keep_turns else torch.zeros_like(is_turn)[:, None]
        batch["completion_mask"] = inputs["completion_mask"] * keep
        model.zero_grad()
        loss = compute_loss(trainer, model, batch)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        return sum(g.abs().sum().item() for g in grads if g is not None)

    assert grad_norm(keep_turns=True) > 0 and grad_norm(keep_turns=False) == 0
    from mlflow.tracking import MlflowClient

    metrics = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(result.mlflow_run_id).data.metrics
    assert metrics["env/turn_samples"] == n and metrics["env/turn_samples_skipped"] == 0


@pytest.mark.parametrize("canonical", [True, False])
def test_a_turn_that_continues_the_conversation_is_trained_on_its_episodes_row(compose_cfg, tmp_path, monkeypatch,
                                                                               canonical):
    """The env renders the whole conversation (opening, first reply, its own turn): its second turn chains onto the
    episode's row, the env's tokens masked, and the tokens trained there are the tokens sampled. A first reply
    sampled as tokens its text does not encode back to (h e, not he) is rebased: the turn is sampled from the
    episode's own tokens, and chained all the same."""
    from grpo_pipeline.training.trainer import PipelineTrainer

    checked, with_turn_rows = [], PipelineTrainer._with_turn_rows

    def check(self, out):  # the policy as it sampled this step (not yet updated)
        new = with_turn_rows(self, out)
        model = self.accelerator.unwrap_model(self.model)
        for r in range(new["advantages"].size(0)):
            length = int(new["completion_mask"][r].sum())
            if "tool_mask" not in new or 0 not in new["tool_mask"][r, :length]:
                continue
            p = new["prompt_ids"][r][new["prompt_mask"][r].bool()].tolist()
            forced = _teacher_forced(model, p, new["completion_ids"][r, :length].tolist(), self.temperature)
            trained = new["tool_mask"][r, :length].bool()
            checked.append((forced[trained], new["sampling_per_token_logps"][r, :length][trained]))
        assert new["num_items_in_batch"].item() == (new["completion_mask"] * new["tool_mask"]).sum().item()
        return new

    monkeypatch.setattr(PipelineTrainer, "_with_turn_rows", check)
    # every sampled turn writes real words (a random model's bytes need not survive decoding and re-encoding), with
    # the sampling copy's real log-probs: the first reply through the runtime, the env's turn through its fast path
    tokenizer = build_tiny_tokenizer()
    he = [tokenizer.convert_tokens_to_ids(t) for t in ("h", "e")]  # the tiny tokenizer encodes "he" as one token
    assert tokenizer("he", add_special_tokens=False)["input_ids"] != he

    def plan(i, k):
        return f"one two {i} {k}" if canonical else he + tokenizer(f" said {i} {k}", add_special_tokens=False)[
            "input_ids"]

    monkeypatch.setattr(turns_module, "generate", scripted(tokenizer, plan, real_logps=True))
    result, batches, _, _ = _train(compose_cfg, tmp_path, monkeypatch, env=SeedEnv(whole_conversation=True))
    from mlflow.tracking import MlflowClient

    history = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_metric_history
    chained_ = sum(m.value for m in history(result.mlflow_run_id, "env/turn_samples_chained"))
    apart = sum(m.value for m in history(result.mlflow_run_id, "env/turn_samples"))
    assert chained_ == 8 and apart == 0  # every sample chained onto its episode's row
    assert sum(m.value for m in history(result.mlflow_run_id, "env/turn_calls_rebased")) == (0 if canonical else 8)
    assert len(checked) == chained_ and all(b["advantages"].size(0) < 8 for b in batches)  # fewer rows
    for forced, sampled in checked:  # teacher-forced log-probs of the chained tokens == the sampled ones
        assert torch.allclose(forced, sampled, atol=1e-3)


@pytest.mark.parametrize("whole_conversation", [False, True])
def test_the_kl_terms_reference_log_probs_cover_every_row_trained(compose_cfg, tmp_path, monkeypatch,
                                                                  whole_conversation):
    """With a KL term (loss=grpo), the reference log-probs are computed once, after the env's turns joined the
    batch (rows of their own) or grew their episode's row (chained): TRL's own pass before scoring is skipped, and
    every row trained, each token, carries the reference model's log-prob of it."""
    from trl import GRPOTrainer

    betas, generate_and_score = [], GRPOTrainer._generate_and_score_completions

    def trl_pass(self, inputs):
        betas.append(self.beta)
        return generate_and_score(self, inputs)

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", trl_pass)
    result, batches, losses, _ = _train(compose_cfg, tmp_path, monkeypatch,
                                        env=SeedEnv(whole_conversation=whole_conversation))
    trainer, model, _ = losses[0]
    assert betas == [0.0, 0.0] and trainer.beta == pytest.approx(0.04)  # loss=grpo's kl_coef, back for the loss
    from mlflow.tracking import MlflowClient

    metrics = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(result.mlflow_run_id).data.metrics
    assert metrics["env/turn_samples_chained" if whole_conversation else "env/turn_samples"] > 0
    model = trainer.accelerator.unwrap_model(model)
    checked = 0
    for out in batches:
        assert out["ref_per_token_logps"].shape == out["completion_ids"].shape
        for r in range(out["advantages"].size(0)):
            length = int(out["completion_mask"][r].sum())
            p = out["prompt_ids"][r][out["prompt_mask"][r].bool()].tolist()
            with model.disable_adapter():  # the reference of a LoRA run: the base model, adapter off
                forced = _teacher_forced(model, p, out["completion_ids"][r, :length].tolist(), trainer.temperature)
            assert torch.allclose(forced, out["ref_per_token_logps"][r, :length], atol=1e-4), r
            checked += 1
    assert checked == sum(b["advantages"].size(0) for b in batches)


def test_train_env_calls_false_trains_the_first_reply_alone(compose_cfg, tmp_path, monkeypatch):
    result, batches, _, _ = _train(compose_cfg, tmp_path, monkeypatch, ["runtime.train_env_calls=false"])
    assert result.steps == 2 and all(b["advantages"].size(0) == 4 for b in batches)


def test_greedy_env_calls_are_counted_and_kept_out_of_the_loss(compose_cfg, tmp_path, monkeypatch):
    result, batches, _, _ = _train(compose_cfg, tmp_path, monkeypatch, env=SeedEnv(greedy=True))
    assert all(b["advantages"].size(0) == 4 for b in batches)
    from mlflow.tracking import MlflowClient

    metrics = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(result.mlflow_run_id).data.metrics
    assert metrics["env/turn_samples"] == 0 and metrics["env/turn_samples_skipped"] == 4


def test_a_seed_style_run_resumes_and_keeps_its_ledger(compose_cfg, tmp_path):
    overrides = [*tiny_overrides(tmp_path, ["env=custom", "env._target_=unused.Env"]), "training.save_steps=1"]
    first = recipe.train(compose_cfg([*overrides, "training.max_steps=1"]), launch_dir=str(tmp_path), env=SeedEnv())
    assert first.steps == 1
    cfg = compose_cfg([*overrides, "training.max_steps=2", f"resume={tmp_path / 'run'}"])
    resumed = recipe.train(cfg, launch_dir=str(tmp_path), env=SeedEnv())
    assert resumed.steps == 2 and resumed.mlflow_run_id == first.mlflow_run_id
    from mlflow.tracking import MlflowClient

    from grpo_pipeline.tracking.ledger import read

    history = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_metric_history(resumed.mlflow_run_id,
                                                                                     "env/turn_samples")
    assert sorted(m.step for m in history) == [1, 2] and all(m.value == 4 for m in history)
    steps = [e["step"] for e in read(tmp_path / "run" / "episodes.jsonl") if e["split"] == "train"]
    assert sorted(set(steps)) == [1, 2] and all(steps.count(s) == 4 for s in (1, 2))


class _Booker:
    """A stand-in model for HotelSeedEnv: its second turn books the room its first turn's search showed."""

    device = torch.device("cpu")

    def __init__(self, tokenizer, text):
        self.tokenizer, self.text, self.calls = tokenizer, text, 0

    def generate(self, input_ids, attention_mask, max_new_tokens):
        self.calls += 1
        new = self.tokenizer(self.text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        return torch.cat([input_ids, new], dim=1)


def test_the_seed_style_hotel_runs_its_own_turns():
    tokenizer = build_tiny_tokenizer()
    env = HotelSeedEnv()
    assert env.respond is None  # the runtime does not drive its turns
    request = env.build_dataset(tokenizer)[0]["request"]
    args = {k: request[k] for k in ("city", "guests", "max_price")}
    search = f'<tool_call>{json.dumps({"name": "search_rooms", "arguments": args})}</tool_call>'
    best = next(r for r in env.search_rooms(**args) if env.wishes_met(r, request)[0] == env.wishes_met(r, request)[1])
    book = f'<tool_call>{json.dumps({"name": "book_room", "arguments": {"room_id": best["room_id"]}})}</tool_call>'
    model = _Booker(tokenizer, book)
    assert env.score_episode(model, tokenizer, search, request) == 1.0 and model.calls == 1
    nothing = _Booker(tokenizer, "I cannot help.")
    assert env.score_episode(nothing, tokenizer, "Hello", request) == 0.0 and nothing.calls == env.max_turns - 1


class ChatEnv(SeedEnv):
    """Renders the whole conversation each time and asks twice: the second call's context is the first call's plus
    the env's new turn."""

    def score_episode(self, model, tokenizer, completion, i):
        messages = [{"role": "system", "content": "You are a counting assistant. " * 4},
                    {"role": "user", "content": f"Count to {i}"}, {"role": "assistant", "content": completion}]
        for _ in range(2):
            messages.append({"role": "user", "content": "Again, please."})
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
            out = model.generate(**inputs, max_new_tokens=6)
            messages.append({"role": "assistant", "content": tokenizer.decode(out[0, inputs["input_ids"].shape[1]:],
                                                                              skip_special_tokens=True)})
        return 0.5


@pytest.mark.parametrize("reuse", [True, False])
def test_recorded_calls_continue_their_episodes_kv_cache(tiny, monkeypatch, reuse):
    """An env call whose context starts with its episode's tokens (the first reply, then what its earlier calls
    sampled) feeds only the tokens after them: it continues the episode's KV cache, and samples what a full prefill
    would (the sampled log-probs are the model's, teacher-forced on the whole context)."""
    from grpo_pipeline.rollout.turns import Rollout

    tokenizer, model = tiny
    env = ChatEnv()
    runner = EpisodeRunner(env, tokenizer, RuntimeConfig(), ["i"], sampling=SAMPLING)
    runner.bind(model)
    rollout = Rollout(env, tokenizer, runner, max_turns=1, turn_tokens=6, max_episode_tokens=6, reuse_cache=reuse)
    fed, contexts = [], []
    decode = turns_module.decode
    monkeypatch.setattr(turns_module, "decode", lambda model, ids, mask, *a, **kw: (
        fed.append(int(mask[:, (a[4] if len(a) > 4 else 0):].sum())), decode(model, ids, mask, *a, **kw))[1])
    data = env.build_dataset(tokenizer)
    rows = [{"i": i} for i in range(4)]
    torch.manual_seed(0)
    trajs = rollout.run(model, data["prompt"][:4], rows, SAMPLING)
    assert (rollout._episode_caches is not None) == reuse
    recorders = [CallRecorder(SAMPLING, t.prompt_ids + t.completion_ids, tokenizer) for t in trajs]
    fed.clear()
    used, fast = [], runner.fast_generate
    runner.fast_generate = lambda *a: used.append(len(a[0])) or fast(*a)
    episodes = runner.run_episodes([t.text for t in trajs], rows, recorders=recorders)
    assert all(ep.error is None for ep in episodes) and sum(used) == 8  # both calls of each, by the decode loop
    for rec in recorders:
        assert len(rec.samples) == 2
        contexts += [len(s.prompt_ids) for s in rec.samples]
        for sample in rec.samples:
            forced = _teacher_forced(model, sample.prompt_ids, sample.completion_ids, SAMPLING["temperature"])
            assert torch.allclose(forced, torch.tensor(sample.logprobs), atol=1e-4)
    # what the calls' decodes fed (real tokens, before sampling) against the contexts the calls had
    assert len(fed) >= 2 and sum(fed) < sum(contexts) / 3 if reuse else sum(fed) == sum(contexts)
    # scoring a training batch releases the step's episode caches
    rollout.run(model, data["prompt"][:4], rows, SAMPLING)
    assert (rollout._episode_caches is not None) == reuse
    runner._score([t.text for t in trajs], rows, False, episode_ids=[t.prompt_ids + t.completion_ids for t in trajs])
    assert rollout._episode_caches is None
