"""The runtime's own generation: episodes generated turn by turn, for a whole batch at once.

Every env's completions are sampled here (single-turn envs: one turn), unless TRL must generate (its
tool loop, vLLM); see `make_rollout`.

An env with a `respond(messages, **row)` method owns the conversation, not the generation: the runtime
samples turn k of every live episode in one batched `generate` call, asks the env (concurrently, with the
runtime's timeouts and failure policy) for its reply to each, appends it, and goes on until the env
returns None (done), the episode reaches its `max_turns` assistant turns, or its token budget.

Each episode becomes one trajectory for TRL: `prompt_ids` (the opening messages, rendered by the chat
template), `completion_ids` (every assistant turn and every env turn, in order), `env_mask` (1 on the
tokens the model sampled, 0 on the env's) and `logprobs` (of the sampled tokens). The tokens trained are
exactly the tokens sampled: an assistant turn is never decoded and re-encoded; only the env's turns are
tokenized, once, and the next turn is generated from those very ids.

A shared-prefix KV cache (`SharedPrefix`) spares the prefill of what every episode's context starts
with (the system prompt, a worked example): it is computed once per batch and reused for every turn.
"""

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.generation import utils as generation_utils

from grpo_pipeline.envs.loader import get_tool_schemas
from grpo_pipeline.errors import ConfigError
from grpo_pipeline.prompts import env_turn_text, render_prompt, supports_tools

GREEDY = {"do_sample": False}
# transformers renamed generate's `past_key_values` to `cache` (5.2x)
_CACHE_KWARG = "cache" if hasattr(generation_utils, "DEPRECATED_CACHE_NAMES") else "past_key_values"


@dataclass
class Trajectory:
    prompt: Any  # the opening: a string or chat messages
    row: dict
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # the episode after the opening: assistant and env turns
    turns: int = 0  # assistant turns
    env_tokens: int = 0
    cut: bool = False  # stopped by the token budget
    failure: str | None = None  # why an env call failed (the episode counts as failed)
    done: bool = False
    seconds: float = 0.0  # in env calls

    @property
    def text(self) -> str:
        return "".join(str(m.get("content") or "") for m in self.messages if m.get("role") == "assistant")


def make_rollout(cfg, env, tokenizer, runner, tool_functions: list) -> "Rollout | None":
    """The runtime's own generation for this run, or None where TRL must generate (its tool loop for
    `get_tool_functions`, vLLM). Multi-turn for an env with `respond`; a single turn otherwise (the same
    batched generate with the shared-prefix cache, and exact log-probs)."""
    multi_turn = callable(getattr(env, "respond", None))
    if multi_turn and tool_functions:
        raise ConfigError(f"{type(env).__qualname__} has both respond() and get_tool_functions(): a multi-turn env "
                          "runs its tools in respond; drop get_tool_functions.")
    if tool_functions or cfg.vllm.mode != "off":
        return None
    tools = get_tool_schemas(env) if supports_tools(tokenizer) else None
    if not multi_turn:
        tokens = cfg.generation.max_new_tokens
        return Rollout(env, tokenizer, runner, max_turns=1, turn_tokens=tokens, max_episode_tokens=tokens, tools=tools)
    return Rollout(env, tokenizer, runner,
                   max_turns=int(getattr(env, "max_turns", None) or cfg.runtime.max_turns),
                   turn_tokens=int(getattr(env, "turn_max_new_tokens", None) or cfg.generation.max_new_tokens),
                   max_episode_tokens=cfg.runtime.max_episode_tokens, tools=tools)


class Rollout:
    def __init__(self, env, tokenizer, runner, max_turns: int, turn_tokens: int, max_episode_tokens: int,
                 tools: list[dict] | None = None):
        self.env, self.tokenizer, self.runner = env, tokenizer, runner
        self.multi_turn = callable(getattr(env, "respond", None))
        self.max_turns, self.turn_tokens, self.max_episode_tokens = max_turns, turn_tokens, max_episode_tokens
        self.tools = tools
        self.eos_ids = _as_list(tokenizer.eos_token_id)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]

    # --- the episode loop ------------------------------------------------------------------------
    def run(self, model, prompts: list, rows: list[dict], sampling: dict) -> list[Trajectory]:
        trajs = [self._start(p, r) for p, r in zip(prompts, rows, strict=True)]
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                prefix = SharedPrefix.build(model, [t.prompt_ids for t in trajs])
                for turn in range(self.max_turns):
                    live = [t for t in trajs if not t.done]
                    if not live:
                        break
                    self._assistant_turn(model, live, sampling, prefix)
                    live = [t for t in live if not t.done]
                    if turn == self.max_turns - 1:
                        break
                    self._env_turn(live)
        finally:
            model.train(was_training)
        for t in trajs:
            t.done = True
        return trajs

    def _start(self, prompt, row: dict) -> Trajectory:
        text, is_chat = render_prompt(self.tokenizer, prompt, self.tools)
        ids = self.tokenizer(text, add_special_tokens=not is_chat)["input_ids"]
        return Trajectory(prompt=prompt, row=row, prompt_ids=list(ids))

    def _assistant_turn(self, model, live: list[Trajectory], sampling: dict, prefix: "SharedPrefix") -> None:
        limits = [min(self.turn_tokens, self.max_episode_tokens - len(t.completion_ids)) for t in live]
        new_ids, new_logps = generate(model, [t.prompt_ids + t.completion_ids for t in live], max(limits), sampling,
                                      self.eos_ids, self.pad_id, prefix, with_logprobs=sampling.get("do_sample", False))
        for t, ids, logps, limit in zip(live, new_ids, new_logps, limits, strict=True):
            ids, logps = ids[:limit], logps[:limit]
            t.completion_ids += ids
            t.env_mask += [1] * len(ids)
            t.logprobs += logps
            t.turns += 1
            t.messages.append({"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=True)})
            if len(t.completion_ids) >= self.max_episode_tokens or (limit < self.turn_tokens and len(ids) == limit):
                t.done = t.cut = True  # the episode's token budget is spent

    def _env_turn(self, live: list[Trajectory]) -> None:
        """The env's reply to each live episode, concurrently; an episode whose reply is None is done."""
        calls = [lambda t=t: self.env.respond(_conversation(t), **t.row) for t in live]
        outcomes = self.runner.call_env(calls, "respond", [t.row for t in live], [t.text for t in live])
        for t, (reply, failure, seconds) in zip(live, outcomes, strict=True):
            t.seconds += seconds
            if failure is not None:
                t.failure, t.done = failure, True
                continue
            if reply is None:
                t.done = True
                continue
            message = _as_message(reply, self.env)
            text = env_turn_text(self.tokenizer, _conversation(t), message, self.tools,
                                 ended_with_eos=bool(t.completion_ids) and t.completion_ids[-1] in self.eos_ids)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(t.completion_ids) + len(ids) >= self.max_episode_tokens:
                t.done = t.cut = True  # no room left for another assistant turn
                continue
            t.completion_ids += ids
            t.env_mask += [0] * len(ids)
            t.logprobs += [0.0] * len(ids)
            t.env_tokens += len(ids)
            t.messages.append(message)


def _conversation(t: Trajectory) -> list[dict]:
    opening = t.prompt if isinstance(t.prompt, list) else [{"role": "user", "content": t.prompt}]
    return list(opening) + t.messages


def _as_message(reply, env) -> dict:
    if isinstance(reply, str):
        return {"role": "user", "content": reply}
    if isinstance(reply, dict) and isinstance(reply.get("content"), str) and reply.get("role") in ("user", "tool"):
        return dict(reply)
    raise TypeError(f"{type(env).__qualname__}.respond returned {reply!r}: return the env's reply as a string (a user "
                    "turn), a message {'role': 'user' | 'tool', 'content': str}, or None when the episode is over.")


def _as_list(value) -> list[int]:
    return [] if value is None else list(value) if isinstance(value, list | tuple) else [value]


# --- batched generation ------------------------------------------------------------------------------
class SharedPrefix:
    """The KV cache of the longest token prefix that every sequence of a batch starts with."""

    def __init__(self, ids: list[int], cache):
        self.ids, self.cache = ids, cache

    @classmethod
    def build(cls, model, sequences: list[list[int]], min_tokens: int = 16) -> "SharedPrefix | None":
        n = _common_prefix_length(sequences) - 1  # leave at least one token per sequence to feed
        if n < min_tokens:
            return None
        ids = sequences[0][:n]
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids], device=model.device), use_cache=True)
        return cls(ids, getattr(out, "cache", None) or out.past_key_values)

    def covers(self, sequences: list[list[int]]) -> bool:
        n = len(self.ids)
        return all(len(s) > n and s[:n] == self.ids for s in sequences)

    def expanded(self, batch: int):
        import copy

        cache = copy.deepcopy(self.cache)
        cache.batch_repeat_interleave(batch)
        return cache


def _common_prefix_length(sequences: list[list[int]]) -> int:
    first, n = sequences[0], min(len(s) for s in sequences)
    for i in range(n):
        if any(s[i] != first[i] for s in sequences[1:]):
            return i
    return n


def generate(model, sequences: list[list[int]], max_new_tokens: int, sampling: dict, eos_ids: list[int],
             pad_id: int, prefix: SharedPrefix | None = None, with_logprobs: bool = True
             ) -> tuple[list[list[int]], list[list[float]]]:
    """One batched generate over token-id sequences of different lengths. Returns, per sequence, the sampled
    ids up to and including its first eos, and their log-probabilities under the sampling temperature.

    With a shared prefix, every sequence is laid out as [prefix | left padding | its own tokens]: the prefix's
    KV cache is reused, and the holes are masked (positions come from the attention mask, so each token
    keeps the position it would have without padding)."""
    device = model.device
    use_prefix = prefix is not None and prefix.covers(sequences)
    start = len(prefix.ids) if use_prefix else 0
    tails = [s[start:] for s in sequences]
    width = max(len(t) for t in tails)
    ids = torch.full((len(tails), start + width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    if use_prefix:
        ids[:, :start] = torch.tensor(prefix.ids)
        mask[:, :start] = 1
    for i, tail in enumerate(tails):
        ids[i, start + width - len(tail):] = torch.tensor(tail)
        mask[i, start + width - len(tail):] = 1
    kwargs = dict(sampling)
    if use_prefix:
        kwargs[_CACHE_KWARG] = prefix.expanded(len(tails))
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                         pad_token_id=pad_id, eos_token_id=eos_ids, return_dict_in_generate=True,
                         output_logits=with_logprobs, **kwargs)
    new = out.sequences[:, ids.shape[1]:].cpu()
    logps = torch.zeros(new.shape)
    if with_logprobs and out.logits:  # log-probabilities of the sampled tokens, as TRL computes them
        temperature = float(sampling.get("temperature", 1.0)) if sampling.get("do_sample") else 1.0
        steps = torch.stack(out.logits, dim=1).float().cpu()
        logps = torch.log_softmax(steps / temperature, dim=-1).gather(-1, new[:, : steps.shape[1], None]).squeeze(-1)
    result_ids, result_logps = [], []
    for row, row_logps in zip(new.tolist(), logps.tolist(), strict=True):
        end = next((i + 1 for i, tok in enumerate(row) if tok in eos_ids), len(row))
        result_ids.append(row[:end])
        result_logps.append(row_logps[:end])
    return result_ids, result_logps
