"""The runtime's own decode loop and the shared-prefix loss forward are exact: greedy tokens equal
`model.generate`'s, sampling follows generate's warpers and distribution, and the loss log-probs, entropies
and gradients equal TRL's own path."""

import contextlib

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper
from trl.trainer.utils import add_fused_lm_head

from grpo_pipeline.config.schema import ModelConfig
from grpo_pipeline.models import build_tiny_model, build_tiny_tokenizer
from grpo_pipeline.rollout import decode as sampler
from grpo_pipeline.rollout.turns import SharedPrefix, generate
from grpo_pipeline.training.prefix_logps import (
    MIN_PREFIX,
    length_groups,
    per_token_logps,
    shared_prefix_length,
    supported,
)


@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_tiny_tokenizer()
    tokenizer.padding_side = "left"
    torch.manual_seed(0)
    return tokenizer, build_tiny_model(ModelConfig(name="tiny", source="tiny"), tokenizer).eval()


def _prompts(tokenizer, n: int) -> list[list[int]]:
    system = "You are a careful assistant who counts things. " * 3
    rows = []
    for i in range(n):
        text = tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": f"count {'to ' * (i % 3)}{i}"}],
            tokenize=False, add_generation_prompt=True)
        rows.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return rows


def _hf_greedy(model, tokenizer, seqs, n, eos):
    """model.generate on the same left-padded batch, cut after each row's first eos."""
    batch = tokenizer.pad({"input_ids": seqs}, return_tensors="pt")
    out = model.generate(**batch, max_new_tokens=n, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=eos)
    rows = out[:, batch["input_ids"].size(1):].tolist()
    return [row[:next((i + 1 for i, t in enumerate(row) if t in eos), len(row))] for row in rows]


@pytest.mark.parametrize("use_prefix", [False, True])
def test_greedy_decode_equals_generate(tiny, use_prefix, monkeypatch):
    tokenizer, model = tiny
    seqs = _prompts(tokenizer, 6)
    # an eos id the random model emits early for some rows and late for others: rows leave the batch at
    # different steps (compaction after every finished row), and the others must be unaffected
    with torch.no_grad():
        probe, _ = generate(model, seqs, 12, {"do_sample": False}, [], tokenizer.pad_token_id)
    eos = [probe[0][3], probe[-1][7]]
    monkeypatch.setattr(sampler, "COMPACT_SHARE", 0.01)
    with torch.no_grad():
        prefix = SharedPrefix.build(model, seqs) if use_prefix else None
        assert (prefix is not None) == use_prefix
        ours, logps = generate(model, seqs, 12, {"do_sample": False}, eos, tokenizer.pad_token_id, prefix)
        expected = _hf_greedy(model, tokenizer, seqs, 12, eos)
    assert ours == expected
    assert len({len(r) for r in ours}) > 1  # rows did end at different steps
    assert all(len(lp) == len(r) and all(x <= 0 for x in lp) for lp, r in zip(logps, ours, strict=True))


def test_sampled_logprobs_are_the_models_teacher_forced_ones(tiny):
    tokenizer, model = tiny
    seqs = _prompts(tokenizer, 4)
    torch.manual_seed(3)
    with torch.no_grad():
        ids, logps = generate(model, seqs, 10, {"do_sample": True, "temperature": 0.7}, [tokenizer.eos_token_id],
                              tokenizer.pad_token_id, SharedPrefix.build(model, seqs))
        for seq, new, lp in zip(seqs, ids, logps, strict=True):
            logits = model(torch.tensor([seq + new])).logits[0, len(seq) - 1:-1].float() / 0.7
            forced = torch.log_softmax(logits, -1).gather(-1, torch.tensor(new)[:, None]).squeeze(-1)
            assert torch.allclose(forced, torch.tensor(lp), atol=1e-4)


def test_top_k_and_top_p_match_generates_warpers():
    torch.manual_seed(0)
    logits = torch.randn(5, 50) * 3
    for k in (1, 5, 49):
        assert torch.equal(sampler._warp(logits, k, 1.0), TopKLogitsWarper(k)(None, logits.clone()))
    for p in (0.1, 0.5, 0.9):
        assert torch.equal(sampler._warp(logits, 0, p), TopPLogitsWarper(p)(None, logits.clone()))
    both = TopPLogitsWarper(0.8)(None, TopKLogitsWarper(10)(None, logits.clone()))
    assert torch.equal(sampler._warp(logits, 10, 0.8), both)


def test_inverse_cdf_sampling_follows_the_softmax():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5]]).repeat(40000, 1)
    draws = sampler._sample(logits)
    freq = torch.bincount(draws, minlength=6).float() / len(draws)
    assert freq[4] == 0  # a masked token is never drawn
    assert torch.allclose(freq, logits[0].softmax(-1), atol=0.01)


def _lora_model(tokenizer):
    torch.manual_seed(1)
    model = build_tiny_model(ModelConfig(name="tiny", source="tiny"), tokenizer)
    add_fused_lm_head(model, temperature=0.8, outputs=("log_probs", "entropy"))
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        task_type="CAUSAL_LM", init_lora_weights=False, lora_dropout=0.0)
    return get_peft_model(model, config)


def _batch(tokenizer, vocab: int):
    prompts = _prompts(tokenizer, 4)
    prompts = [p for p in prompts for _ in range(2)]  # groups of 2 share a prompt
    width, length = max(map(len, prompts)), 9  # 8 rows: completions of 2..9 tokens
    ids = torch.full((len(prompts), width + length), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    torch.manual_seed(2)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):width] = torch.tensor(p)
        mask[i, width - len(p):width] = 1
        n = 2 + i  # completions of different lengths (the longest fills the width), right-padded
        ids[i, width:width + n] = torch.randint(5, vocab, (n,))
        mask[i, width:width + n] = 1
    return ids, mask, length


def _loss_path_matches_trls(model, ids, mask, length, prefix, batch_size) -> tuple[int, int]:
    """Runs TRL's loss forward and the shared-prefix one on the same batch, backward through both (log-probs plus
    0.3 x entropy over the attended completion tokens), and asserts the same log-probs, entropies and LoRA
    gradients. Returns the tokens each fed through the model (TRL's, ours)."""
    keep = mask[:, -length:].bool()
    fed = []
    hook = model.get_input_embeddings().register_forward_pre_hook(lambda _m, args: fed.append(args[0].numel()))

    def run(fn):
        model.zero_grad()
        fed.clear()
        logps, entropy = fn()
        (logps[keep].sum() + 0.3 * entropy[keep].sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return logps.detach(), entropy.detach(), grads, sum(fed)

    def trl_path():
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :-length] = -100
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        return out.log_probs[:, -length:], out.entropy[:, -length:]

    try:
        expected = run(trl_path)
        ours = run(lambda: per_token_logps(model, ids, mask, length, prefix, True, batch_size,
                                           contextlib.nullcontext))
    finally:
        hook.remove()
    assert torch.allclose(ours[0][keep], expected[0][keep], atol=1e-5)
    assert torch.allclose(ours[1][keep], expected[1][keep], atol=1e-5)
    assert expected[2].keys() == ours[2].keys() and len(expected[2]) > 0
    for name, grad in expected[2].items():
        # fp32 sums in another order: elements near zero differ by ~1e-3 relatively (CPU-dependent), so the error
        # is measured against each tensor's scale (here ~1e-6 of it; a wrong path is off by its whole size)
        error = (ours[2][name] - grad).abs().max() / grad.abs().max()
        assert error < 1e-4, (name, error.item())
    assert (ours[0][~keep] == 0).all() and (ours[1][~keep] == 0).all()  # padding: 0, as the loss masks it
    return expected[3], ours[3]


def test_shared_prefix_loss_equals_trls_logprobs_entropies_and_gradients():
    tokenizer = build_tiny_tokenizer()
    model = _lora_model(tokenizer)
    ids, mask, length = _batch(tokenizer, model.config.vocab_size)
    prefix = shared_prefix_length(ids, mask, ids.size(1) - length)
    assert prefix >= MIN_PREFIX
    _loss_path_matches_trls(model, ids, mask, length, prefix, batch_size=3)


def test_shared_prefix_loss_runs_each_row_only_as_long_as_its_group_needs():
    """Rows run in length groups padded to their own longest member, not the batch's longest completion (a
    multi-turn batch is ~half padding): fewer tokens through the model, the same log-probs, entropies and
    gradients as TRL's path, a fully masked completion (TRL's mask_truncated_completions) included."""
    tokenizer = build_tiny_tokenizer()
    model = _lora_model(tokenizer)
    ids, mask, length = _batch(tokenizer, model.config.vocab_size)
    ids = torch.cat([ids, torch.randint(5, model.config.vocab_size, (ids.size(0), 30))], dim=1)
    mask = torch.cat([mask, torch.zeros((ids.size(0), 30), dtype=mask.dtype)], dim=1)
    mask[0, -length - 30:] = 1  # one episode 30 tokens longer than the rest: the batch is padded to it
    mask[3, -length - 30:] = 0  # a truncated completion, masked whole
    length += 30
    prefix = shared_prefix_length(ids, mask, ids.size(1) - length)
    trls, ours = _loss_path_matches_trls(model, ids, mask, length, prefix, batch_size=8)
    real = int(mask.sum()) - (ids.size(0) - 1) * prefix  # every row's own tokens, the prefix once
    assert ours < 0.6 * trls  # TRL's layout: 8 rows x the longest
    assert ours <= 1.3 * real, (ours, real)


def test_length_groups_keep_padding_within_the_slack_and_every_row_once():
    tails, completions = [3, 3, 4, 3, 3, 3], [2, 40, 2, 38, 1, 41]
    groups = length_groups(tails, completions, most=4)
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert [sorted(g) for g in groups] == [[0, 2, 4], [1, 3, 5]]  # short rows apart from long ones
    for g in groups:
        padded = len(g) * (max(tails[i] for i in g) + max(completions[i] for i in g))
        assert padded <= 1.25 * sum(tails[i] + completions[i] for i in g)
    assert all(len(g) == 1 for g in length_groups(tails, completions, most=1))


def test_the_kl_reference_through_the_shared_prefix_is_the_model_without_its_adapter():
    """loss.kl_coef > 0 with LoRA: TRL computes the reference log-probs with the adapter switched off (trl.models
    use_adapter); the shared-prefix path recomputes the prefix's KV cache inside that context, so no adapter
    leaks into the reference."""
    from trl.trainer.utils import use_adapter

    tokenizer = build_tiny_tokenizer()
    model = _lora_model(tokenizer)  # init_lora_weights=False: the adapter changes the log-probs
    ids, mask, length = _batch(tokenizer, model.config.vocab_size)
    prefix = shared_prefix_length(ids, mask, ids.size(1) - length)
    keep = mask[:, -length:].bool()

    def logps():
        with torch.no_grad():
            return per_token_logps(model, ids, mask, length, prefix, False, 3, contextlib.nullcontext)[0][keep]

    policy = logps()
    with use_adapter(model, adapter_name=None):
        reference = logps()
    with model.disable_adapter(), torch.no_grad():  # the base model's own forward, no shared prefix
        labels = ids.masked_fill(mask == 0, -100)
        base = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs[:, -length:][keep]
    assert torch.allclose(reference, base, atol=1e-5)
    assert (policy - base).abs().max() > 1e-2  # the adapter does change them: the check above can fail
    assert torch.allclose(logps(), policy)  # and the adapter is back on afterwards


def test_shared_prefix_loss_runs_only_where_it_is_exact():
    """Its boolean 4D mask means "may attend" to sdpa only (eager attention adds it: nothing masked), it assumes
    rotary positions and no sliding window, and one prefix pass shares one dropout mask across the rows."""
    tokenizer = build_tiny_tokenizer()
    model = _lora_model(tokenizer)
    assert model.config._attn_implementation == "sdpa" and supported(model)
    ids, mask, length = _batch(tokenizer, model.config.vocab_size)
    prefix = shared_prefix_length(ids, mask, ids.size(1) - length)
    with torch.no_grad():  # the same mask through eager attention is wrong: the gate is what keeps it out
        sdpa = per_token_logps(model, ids, mask, length, prefix, False, 3, contextlib.nullcontext)[0]
        model.base_model.model.config._attn_implementation = "eager"
        eager = per_token_logps(model, ids, mask, length, prefix, False, 3, contextlib.nullcontext)[0]
    keep = mask[:, -length:].bool()
    assert not torch.allclose(sdpa[keep], eager[keep], atol=1e-3) and not supported(model)
    model.base_model.model.config._attn_implementation = "sdpa"
    model.base_model.model.config.sliding_window = 8
    assert not supported(model)
    model.base_model.model.config.sliding_window = None
    assert supported(model)
    torch.manual_seed(0)
    dropout = get_peft_model(build_tiny_model(ModelConfig(name="tiny", source="tiny"), tokenizer),
                             LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1))
    assert not supported(dropout)


def test_shared_prefix_length_leaves_every_row_a_token_and_sees_no_padding():
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 1], [0, 5, 6, 7, 9, 9, 1], [5, 6, 7, 8, 9, 9, 1]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1], [1] * 7])
    assert shared_prefix_length(ids, mask, 6) == 3  # 5 6 7, then the rows differ
    same = torch.tensor([[5, 6, 7, 1], [5, 6, 7, 2]])
    assert shared_prefix_length(same, torch.ones_like(same), 3) == 2  # identical prompts: one token left each


@pytest.mark.parametrize("pack", [False, True], ids=["plain", "packed"])
def test_merged_copy_generates_like_the_policy_and_is_never_stale(pack):
    from grpo_pipeline.rollout.policy_copy import MergedCopy, PackedLinear, can_pack

    if pack and not can_pack():
        pytest.skip("this torch has no oneDNN")
    tokenizer = build_tiny_tokenizer()
    policy = _lora_model(tokenizer).eval()
    merged = MergedCopy(pack=pack)
    ids = torch.tensor([_prompts(tokenizer, 1)[0]])

    def logits(model):
        with torch.no_grad():
            return model(input_ids=ids).logits

    plain = merged.of(policy)
    assert plain is not policy and not any("lora" in n for n, _ in plain.named_modules())
    linears = [m for m in plain.modules() if isinstance(m, torch.nn.Linear | PackedLinear)]
    assert linears and all(isinstance(m, PackedLinear) == pack for m in linears)  # LM head included
    assert torch.allclose(logits(plain), logits(policy), atol=1e-5)
    with torch.no_grad():  # an optimizer step on the adapter
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * 0.5)
    assert not torch.allclose(logits(plain), logits(policy), atol=1e-3)  # the copy as it was: stale
    assert merged.of(policy) is plain  # refreshed in place, not rebuilt
    assert torch.allclose(logits(plain), logits(policy), atol=1e-5)
    with policy.disable_adapter():  # the base weights were not touched by merging
        base = logits(policy)
    assert not torch.allclose(base, logits(policy), atol=1e-3)
    # a plain (non-LoRA) model generates as itself; packed, from a copy that follows every weight
    model = build_tiny_model(ModelConfig(name="tiny", source="tiny"), tokenizer).eval()
    if not pack:
        assert MergedCopy().of(model) is model
        return
    model.lm_head.weight = model.get_input_embeddings().weight  # tied, as SmolLM2's head is
    whole = MergedCopy(pack=True)
    copied = whole.of(model)
    assert copied is not model and torch.allclose(logits(copied), logits(model), atol=1e-5)
    assert copied.lm_head.weight is copied.get_input_embeddings().weight  # the tied head stays tied
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    assert not torch.allclose(logits(copied), logits(model), atol=1e-3)
    assert whole.of(model) is copied and torch.allclose(logits(copied), logits(model), atol=1e-5)


def test_packed_copy_decodes_the_same_episodes():
    """The runtime's decode loop from a packed copy gives the plain copy's greedy tokens, and sampled tokens with
    log-probs within float32 rounding, on a batch that shrinks as rows end (so the layers see 8 rows down to 1)."""
    from grpo_pipeline.rollout.policy_copy import MergedCopy, can_pack
    from grpo_pipeline.rollout.turns import generate

    if not can_pack():
        pytest.skip("this torch has no oneDNN")
    tokenizer = build_tiny_tokenizer()
    policy = _lora_model(tokenizer).eval()
    prompts = _prompts(tokenizer, 8)
    eos = [tokenizer.eos_token_id, *range(100, 140)]  # a tenth of the vocabulary ends a row: rows end at random
    plain, packed = MergedCopy().of(policy), MergedCopy(pack=True).of(policy)
    with torch.no_grad():
        greedy = [generate(m, prompts, 24, {"do_sample": False}, eos, tokenizer.pad_token_id)[0]
                  for m in (plain, packed)]
        sampled = []
        for m in (plain, packed):
            torch.manual_seed(3)
            sampled.append(generate(m, prompts, 24, {"do_sample": True, "temperature": 1.0}, eos,
                                    tokenizer.pad_token_id))
    assert greedy[0] == greedy[1]
    assert sampled[0][0] == sampled[1][0]
    assert len({len(ids) for ids in sampled[0][0]}) > 1  # rows ended at different steps
    gaps = [abs(a - b) for x, y in zip(sampled[0][1], sampled[1][1], strict=True) for a, b in zip(x, y, strict=True)]
    assert max(gaps) < 1e-4


def test_the_growing_cache_layer_holds_what_concatenation_holds():
    """sampler.GrowingLayer writes into spare room (no copy of the whole cache per decode step): its keys/values
    equal torch.cat's after every update, across a growth of the room, a batch selection and a crop."""
    from transformers.cache_utils import DynamicLayer

    grown, plain = sampler.GrowingLayer(), DynamicLayer()
    torch.manual_seed(0)
    pointers = set()
    for step in range(100):
        n = 30 if step == 0 else 1
        k, v = torch.randn(3, 2, n, 4), torch.randn(3, 2, n, 4)
        if step == 50:
            keep = torch.tensor([0, 2])
            grown.batch_select_indices(keep), plain.batch_select_indices(keep)
        if step == 70:
            grown.crop(-5), plain.crop(-5)
        if step >= 50:
            k, v = k[:2], v[:2]
        out_k, out_v = grown.update(k, v)
        ref_k, ref_v = plain.update(k, v)
        assert torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v)
        assert grown.get_seq_length() == plain.get_seq_length()
        pointers.add(grown.keys.data_ptr())
    assert len(pointers) < 5  # the room moved only when it filled up or the batch changed, not at every step


@pytest.mark.parametrize("pack", [False, True], ids=["plain", "packed"])
def test_merged_copy_of_an_adapted_embedding_keeps_the_tied_head_base(pack):
    """LoRA on the embedding of a model whose LM head is that embedding: in the policy the adapter changes the
    lookup only, and the head reads the base weight; merging writes the delta into the shared tensor, so the copy
    must give its head the base weight apart, and generate as the policy does after every update."""
    from grpo_pipeline.rollout.policy_copy import MergedCopy, PackedLinear, can_pack

    if pack and not can_pack():
        pytest.skip("this torch has no oneDNN")
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(ModelConfig(name="tiny", source="tiny"), tokenizer)
    model.lm_head.weight = model.get_input_embeddings().weight
    base_head = model.lm_head.weight.detach().clone()
    torch.manual_seed(2)
    policy = get_peft_model(model, LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"], init_lora_weights=False,
                                              lora_dropout=0.0, task_type="CAUSAL_LM")).eval()
    ids = torch.tensor([_prompts(tokenizer, 1)[0]])

    def logits(m):
        with torch.no_grad():
            return m(input_ids=ids).logits

    merged = MergedCopy(pack=pack)
    copied = merged.of(policy)
    assert torch.allclose(logits(copied), logits(policy), atol=1e-4)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p) * 0.5)
    assert merged.of(policy) is copied
    assert torch.allclose(logits(copied), logits(policy), atol=1e-4)
    assert torch.equal(copied.lm_head.weight, base_head)  # the base, untouched by the adapter
    assert isinstance(copied.lm_head, PackedLinear) == pack
