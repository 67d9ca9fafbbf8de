"""vLLM for real (the CPU build, `make test-vllm`): the runtime's rollouts through an in-process vLLM engine.

Skipped where vLLM is not installed (the base install). With it, for both ways the policy reaches vLLM
(`vllm.weight_sync`: its weights loaded in place, or its adapter as a LoRARequest): vLLM samples the tokens the
trainer's own model would score the same (log-probs agree), the policy reaches vLLM before every rollout (a stale
copy fails the test, a stale prefix cache too), and two-step training runs (LoRA, and full fine-tuning) sample
every episode through vLLM with the sampler-policy log-prob gap logged (and TRL's importance-sampling ratio for
adapters).
"""

import json
import os
import tempfile
from unittest import mock

import pytest
import torch

pytest.importorskip("vllm")

from conftest import tiny_overrides  # noqa: E402
from grpo_pipeline.api import compose_config  # noqa: E402
from grpo_pipeline.envs.arithmetic import ArithmeticEnv  # noqa: E402
from grpo_pipeline.models import load_model, load_tokenizer, model_dir  # noqa: E402
from grpo_pipeline.recipe import train  # noqa: E402

pytestmark = pytest.mark.vllm
SAMPLING = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}


@pytest.fixture(scope="module", params=["weights", "adapter"])
def engine(request):
    from peft import LoraConfig, get_peft_model

    from grpo_pipeline.rollout.vllm_engine import VllmBackend

    cfg = compose_config([])
    tokenizer = load_tokenizer(cfg.model)
    torch.manual_seed(0)
    policy = get_peft_model(load_model(cfg.model, tokenizer),
                            LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
                                       init_lora_weights=False, lora_dropout=0.0)).eval()
    backend = VllmBackend(model_dir(cfg.model), dtype="float32", max_model_len=512, sync=request.param,
                          lora_rank=16, gpu_memory_utilization=0.3, seed=0)
    dataset = ArithmeticEnv(num_samples=8).build_dataset(tokenizer)
    prompts = [tokenizer.apply_chat_template(dataset[i]["prompt"], tokenize=False, add_generation_prompt=True)
               for i in range(4)]
    seqs = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    yield backend, policy, tokenizer, seqs
    backend.close()


def test_the_engine_leaves_torchs_thread_count_to_the_trainer(engine):
    # vLLM's CPU worker swaps torch.set_num_threads for a warning no-op; the trainer shares the process
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def _teacher_forced(policy, seq, new):
    with torch.no_grad():
        logits = policy(torch.tensor([seq + new])).logits[0, len(seq) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(new)[:, None]).squeeze(-1)


def test_vllm_samples_what_the_policy_scores(engine):
    backend, policy, tokenizer, seqs = engine
    backend.sync(policy)
    ids, logps = backend.generate(seqs, 8, SAMPLING, [tokenizer.eos_token_id])
    assert len(ids) == 4 and all(1 <= len(x) <= 8 for x in ids)
    for seq, new, lp in zip(seqs, ids, logps, strict=True):
        assert torch.allclose(_teacher_forced(policy, seq, new), torch.tensor(lp), atol=2e-3)
    greedy, _ = backend.generate(seqs, 6, {"do_sample": False}, [tokenizer.eos_token_id])
    with torch.no_grad():
        for seq, new in zip(seqs, greedy, strict=True):
            out = policy.generate(torch.tensor([seq]), max_new_tokens=6, do_sample=False,
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            assert out[0, len(seq):].tolist()[:len(new)] == new


def _long_prompt(tokenizer) -> list[int]:
    """A prompt of over 256 tokens: vLLM caches prefixes in whole blocks (128 tokens on a CPU)."""
    prompt = ArithmeticEnv(num_samples=1, num_shot=5).build_dataset(tokenizer)[0]["prompt"]
    ids = tokenizer(tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True),
                    add_special_tokens=False)["input_ids"]
    assert 256 < len(ids) < 400  # the engine holds 512
    return ids


def _cached_tokens(backend, seq) -> int:
    from vllm import SamplingParams, TokensPrompt

    out = backend.llm.generate([TokensPrompt(prompt_token_ids=seq)], SamplingParams(max_tokens=1), use_tqdm=False,
                               lora_request=backend._lora)
    return out[0].num_cached_tokens


def _update_adapter(policy):
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * 0.05)


def test_the_policy_reaches_vllm_before_every_rollout(engine):
    backend, policy, tokenizer, _ = engine
    seq = _long_prompt(tokenizer)
    greedy = {"do_sample": False}
    backend.sync(policy)
    ids, before = backend.generate([seq], 6, greedy, [tokenizer.eos_token_id])
    assert _cached_tokens(backend, seq) >= 128  # the prompt's prefix is in vLLM's prefix cache
    _update_adapter(policy)
    _, stale = backend.generate([seq], 6, greedy, [tokenizer.eos_token_id])
    assert stale == before  # without a sync vLLM still has the old policy: this is what a stale copy looks like
    version = backend.version
    backend.sync(policy)
    assert backend.version == version + 1
    # the same prompt again: its prefix's keys and values, cached under the old policy, must not be reused
    new_ids, after = backend.generate([seq], 6, greedy, [tokenizer.eos_token_id])
    assert torch.allclose(_teacher_forced(policy, seq, new_ids[0]), torch.tensor(after[0]), atol=2e-3)
    assert new_ids != ids or not torch.allclose(torch.tensor(after[0]), torch.tensor(before[0]), atol=1e-3)
    if backend.sync_mode == "weights":  # the control: the same push without the cache reset serves a stale prefix
        _update_adapter(policy)
        with mock.patch.object(backend.llm, "reset_prefix_cache", return_value=True):
            backend.sync(policy)
        served, logps = backend.generate([seq], 6, greedy, [tokenizer.eos_token_id])
        assert not torch.allclose(_teacher_forced(policy, seq, served[0]), torch.tensor(logps[0]), atol=2e-3)
        backend.sync(policy)


def test_a_kept_prefix_cache_stops_the_run(engine):
    backend, policy, _, _ = engine
    if backend.sync_mode != "weights":
        pytest.skip("an adapter gets a new LoRA id, under which nothing is cached")
    with mock.patch.object(backend.llm, "reset_prefix_cache", return_value=False), \
            pytest.raises(RuntimeError, match="kept its prefix cache"):
        backend.sync(policy)
    backend.sync(policy)


def test_full_fine_tuning_weights_reach_vllm(engine):
    """Without LoRA every weight trains: weight_sync=weights pushes all of them (norms and embeddings included)."""
    import copy

    backend, policy, tokenizer, seqs = engine
    if backend.sync_mode != "weights":
        pytest.skip("full weights reach vLLM through vllm.weight_sync=weights")
    plain = copy.deepcopy(policy).merge_and_unload()  # no adapter: a fully fine-tuned model
    backend.sync(plain)
    ids, before = backend.generate(seqs[:1], 6, {"do_sample": False}, [tokenizer.eos_token_id])
    # weights no LoRA layer holds: the norms, and the embedding (tied to the LM head, which vLLM packs apart)
    changed = {name: p for name, p in plain.named_parameters() if "norm" in name or "embed" in name}
    saved = {name: p.detach().clone() for name, p in changed.items()}
    torch.manual_seed(1)
    try:
        with torch.no_grad():
            for name, p in changed.items():
                p.copy_(p * 1.1 if "norm" in name else p + 0.02 * torch.randn_like(p))
        backend.sync(plain)
        new_ids, after = backend.generate(seqs[:1], 6, {"do_sample": False}, [tokenizer.eos_token_id])
        assert torch.allclose(_teacher_forced(plain, seqs[0], new_ids[0]), torch.tensor(after[0]), atol=2e-3)
        assert new_ids != ids or not torch.allclose(torch.tensor(after[0]), torch.tensor(before[0]), atol=1e-3)
    finally:  # the engine back to the fixture's policy for the tests after this one
        with torch.no_grad():
            for name, p in changed.items():
                p.copy_(saved[name])
        backend.sync(plain)
        backend.sync(policy)


@pytest.mark.parametrize(("policy", "sync"), [("lora", "weights"), ("lora", "adapter"), ("full", "weights")])
def test_two_training_steps_sample_through_vllm(tmp_path, policy, sync):
    overrides = [o for o in tiny_overrides(tmp_path) if not o.startswith("model=")]
    cfg = compose_config([*overrides, "vllm=colocate", "vllm.max_model_len=512", "generation.max_new_tokens=8",
                          "eval.enabled=true", "eval.num_prompts=5", "eval.every_steps=0", f"vllm.weight_sync={sync}",
                          *(["lora=off", "training.learning_rate=1e-5"] if policy == "full" else [])])
    made = []
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp(*args, **kwargs):
        made.append(real_mkdtemp(*args, **kwargs))
        return made[-1]

    with mock.patch("tempfile.mkdtemp", mkdtemp):
        result = train(cfg, launch_dir=str(tmp_path))
    assert result.steps == 2 and result.eval_before["num_prompts"] == 5
    adapters = [d for d in made if "grpo_vllm_lora_" in d]
    assert len(adapters) == (sync == "adapter")  # the adapters handed to vLLM, in one temp dir ...
    assert all(not os.path.exists(d) for d in adapters)  # ... removed at the end
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    metrics = client.get_run(result.mlflow_run_id).data.metrics
    # the trainer's and vLLM's log-probs of the tokens trained agree
    assert metrics["sampling/sampling_logp_difference/max"] < 0.05
    if sync == "adapter":  # vLLM's LoRA kernels: TRL's importance-sampling correction (one more forward) ran
        assert abs(metrics["sampling/importance_sampling_ratio/mean"] - 1.0) < 0.05
    else:  # vLLM holds the policy's weights: its log-probs are the behaviour policy's, no correction forward
        assert "sampling/importance_sampling_ratio/mean" not in metrics
    lines = [json.loads(x) for x in (tmp_path / "run" / "episodes.jsonl").read_text().splitlines()]
    assert {x["split"] for x in lines} == {"test_before", "train", "test_after"}
