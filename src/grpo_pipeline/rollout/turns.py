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

A stateful env (one with `start_episode(prompt, **row) -> (prompt, session)`, e.g. a TRL environment_factory env
through envs/trl_env.py) gets a session per episode before its first turn: the session may extend the opening (TRL
appends reset()'s observation), answers the episode's turns (`session.respond(messages)`) and rides along with the
episode's transcript (`Transcript.session`) to score_episode, which asks it for the score.

A shared-prefix KV cache (`SharedPrefix`) spares the prefill of what every episode's context starts
with (the system prompt, a worked example): it is computed once per batch and used by the first turn. Each
episode's KV cache is kept from one turn to the next (`RowCache`): turn k+1 feeds only the tokens that turn k
did not see (its last sampled token and the env's reply), not the whole conversation again. A seed-style env's own
recorded calls (`sample_for_env`) continue their episodes the same way (`EpisodeCaches`).
"""

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo_pipeline.envs.loader import get_tool_schemas
from grpo_pipeline.envs.runner import as_real
from grpo_pipeline.errors import ConfigError
from grpo_pipeline.prompts import env_turn_text, render_prompt, supports_tools
from grpo_pipeline.rollout.decode import RowCache, cached_rows, decode, expand_cache
from grpo_pipeline.rollout.policy_copy import MergedCopy
from grpo_pipeline.rollout.sentinel import WeightsSentinel
from grpo_pipeline.rollout.vllm_engine import VllmBackend

log = logging.getLogger(__name__)


class Transcript(list):
    """An episode's messages after the opening. A stateful env's episode carries its session along, so that
    score_episode can score it (envs/trl_env.py); pickled, saved or gathered, it is a plain list."""

    session: Any = None
    episode_seed: int | None = None  # a training episode's seed (env methods that declare `episode_seed` get it)

    def __reduce__(self):
        return list, (list(self),)


@dataclass
class Trajectory:
    prompt: Any  # the opening: a string or chat messages
    row: dict
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    messages: Transcript = field(default_factory=Transcript)  # the episode after the opening: assistant and env turns
    turns: int = 0  # assistant turns
    env_tokens: int = 0
    cut: bool = False  # stopped by the token budget
    failure: str | None = None  # why an env call failed (the episode counts as failed)
    done: bool = False
    seconds: float = 0.0  # in env calls
    turn_scores: list[float] = field(default_factory=list)  # the env's score_turn after each assistant turn

    @property
    def text(self) -> str:
        return "".join(str(m.get("content") or "") for m in self.messages if m.get("role") == "assistant")


def make_rollout(plan, env, tokenizer, runner, model_path: Callable[[], str] | None = None) -> "Rollout | None":
    """The runtime's own generation for this run as its plan decided (config/plan.py), or None where TRL
    generates (its tool loop for `get_tool_functions`, its vLLM). Multi-turn for an env with `respond`; a single
    turn otherwise (the same batched generate with the shared-prefix cache, and the sampled tokens' log-probs).
    `model_path()`: the folder vLLM loads (backend runtime+vllm), asked for when the engine starts."""
    if not plan.runtime_generates:
        return None
    tools = get_tool_schemas(env) if supports_tools(tokenizer) else None
    dtype = getattr(torch, plan.generation_dtype) if plan.generation_dtype else None
    vllm = None
    if plan.runtime_vllm:
        if model_path is None:
            raise ValueError("make_rollout: the plan's backend is runtime+vllm; pass model_path")

        def vllm():  # started on first use (~40 s on 2 cores): after every cheap check
            return VllmBackend(model_path(), **plan.vllm_engine)
    return Rollout(env, tokenizer, runner, max_turns=plan.max_turns, turn_tokens=plan.turn_tokens,
                   max_episode_tokens=plan.max_episode_tokens, tools=tools, merged_generation=plan.merged_generation,
                   sampling_dtype=dtype, vllm=vllm, packed=plan.packed_generation, vllm_sync=plan.weight_sync,
                   turn_credit=plan.turn_credit == "turn")


class Rollout:
    def __init__(self, env, tokenizer, runner, max_turns: int, turn_tokens: int, max_episode_tokens: int,
                 tools: list[dict] | None = None, merged_generation: bool = False,
                 sampling_dtype: torch.dtype | None = None, vllm=None, reuse_cache: bool = True,
                 packed: bool = False, vllm_sync: str | None = None, turn_credit: bool = False):
        self.env, self.runner = env, runner
        # runtime.turn_credit=turn: a score for each sampled assistant turn (training/turn_credit.py), the env's
        # score_turn after the turn where it has one, else 0.0
        self.turn_credit = turn_credit
        self.sentinel: WeightsSentinel | None = None  # set by the recipe (sentinel.enabled)
        self._sampler = None  # the copy the last sampled rollout generated from (current until the next update)
        self._episode_caches: EpisodeCaches | None = None  # its episodes' KV caches, for the env's recorded calls
        # a seed-style env whose own generate calls are trained (runtime.train_env_calls): they go through
        # sample_for_env, which continues each episode from its KV cache
        self.for_env = False
        if runner is not None and hasattr(runner, "fast_generate"):
            runner.fast_generate, runner.fast_generate_done = self.sample_for_env, self.release_episode_caches
            self.for_env = bool(getattr(getattr(runner, "cfg", None), "train_env_calls", False))
        self.sentinel_metrics: dict[str, float] = {}
        self.score_turns = turn_credit and callable(getattr(env, "score_turn", None))
        self.vllm_sync = vllm_sync  # how the runtime's vLLM gets the policy: weights | adapter (the run plan's)
        self.tokenizer = getattr(runner, "tokenizer", None) or tokenizer  # the env threads' shared one
        # what generates when vLLM does not (rollout/policy_copy.py): greedy episodes (held-out evaluation) the merged
        # copy in the policy's dtype, so that they score the weights trained; sampled ones the copy in sampling_dtype
        # `packed`: float32 copies hold their linear weights prepacked for oneDNN (merged.PackedLinear; a copy in
        # another dtype stays unpacked)
        self.merged = MergedCopy(pack=packed) if merged_generation else None
        self.sampler = MergedCopy(sampling_dtype, pack=packed) if sampling_dtype is not None else self.merged
        self._vllm_factory, self.vllm = vllm, None  # vllm: a VllmBackend factory (vllm=colocate), started lazily
        self.multi_turn = callable(getattr(env, "respond", None))
        self.stateful = callable(getattr(env, "start_episode", None))  # a session per episode (see the docstring)
        self.max_turns, self.turn_tokens, self.max_episode_tokens = max_turns, turn_tokens, max_episode_tokens
        self.tools = tools
        self.reuse_cache = reuse_cache  # keep each episode's KV cache between turns (False: prefill every turn)
        self.eos_ids = _as_list(tokenizer.eos_token_id)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]

    def check_template(self, prompt, model_name: str) -> None:
        """Fail at startup when the chat template cannot append an env turn token-exactly."""
        _check_template(self, prompt, model_name)

    @property
    def uses_vllm(self) -> bool:
        """Episodes are sampled by vLLM (vllm=colocate)."""
        return self._vllm_factory is not None

    def close(self) -> None:
        """Remove what the run left outside its run dir (the adapters handed to vLLM)."""
        if self.vllm is not None:
            self.vllm.close()

    def longest_episode(self, prompts: list) -> tuple[int, int, int]:
        """(index, prompt tokens, tokens) of the prompt whose episode can grow longest: its prompt ids (as the
        runtime renders them) plus the episode's token budget."""
        lengths = [len(self._start(p, {}).prompt_ids) for p in prompts]
        i = max(range(len(lengths)), key=lengths.__getitem__)
        return i, lengths[i], lengths[i] + self.max_episode_tokens

    # --- the episode loop ------------------------------------------------------------------------
    def run(self, model, prompts: list, rows: list[dict], sampling: dict, turn_tokens: int | None = None,
            step: int = 0) -> list[Trajectory]:
        """Episodes for `prompts` (rows: their dataset columns). `turn_tokens` caps each assistant turn below
        the rollout's own limit (e.g. eval.max_new_tokens). A sampled rollout first checks that the copy it samples
        from holds the policy's weights (`sentinel`, rollout/sentinel.py; its metrics in `sentinel_metrics`)."""
        self.sentinel_metrics = {}
        self._episode_caches = None
        limit = min(self.turn_tokens, turn_tokens or self.turn_tokens)
        trajs = [self._start(p, r) for p, r in zip(prompts, rows, strict=True)]
        if self.multi_turn and sampling.get("do_sample") and hasattr(self.runner, "draw_episode_seeds"):  # held out: None
            for t, seed in zip(trajs, self.runner.draw_episode_seeds(len(trajs)), strict=True):
                t.messages.episode_seed = seed
        if self.stateful:
            self._start_sessions(trajs)
        policy, was_training = model, model.training
        policy.eval()
        try:
            with torch.no_grad():
                if self._vllm_factory is not None:
                    if self.vllm is None:
                        self.vllm = self._vllm_factory()
                    self.vllm.sync(policy)  # before every rollout: vLLM never samples a stale policy
                    model, prefix = None, None
                else:
                    source = self.sampler if sampling.get("do_sample") else self.merged
                    model = source.of(policy) if source is not None else policy  # what generates
                    if self.sentinel is not None and sampling.get("do_sample"):
                        self.sentinel_metrics = self.sentinel.check(policy, model, trajs[0].prompt_ids, step)
                    if sampling.get("do_sample"):
                        self._sampler = (model, dict(sampling))
                    prefix = SharedPrefix.build(model, [t.prompt_ids for t in trajs])
                caches: dict[int, RowCache] = {}  # id(trajectory) -> its KV cache after the last turn
                # a seed-style env's recorded calls continue its episodes: their caches are kept for them
                for_env = (self.for_env and not self.multi_turn and self.reuse_cache and model is not None
                           and bool(sampling.get("do_sample")))
                for turn in range(self.max_turns):
                    live = [t for t in trajs if not t.done]
                    if not live:
                        break
                    self._assistant_turn(model, live, sampling, prefix, limit, caches if self.reuse_cache else None,
                                         keep=turn < self.max_turns - 1 or for_env, keep_done=for_env)
                    if self.turn_credit and sampling.get("do_sample"):
                        self._score_turn(live)
                    live = [t for t in live if not t.done]
                    if turn == self.max_turns - 1:
                        break
                    self._env_turn(live)
                    for t in live:
                        if t.done:
                            caches.pop(id(t), None)
                if for_env:
                    self._episode_caches = EpisodeCaches([(t.prompt_ids + t.completion_ids, caches[id(t)])
                                                          for t in trajs if id(t) in caches])
        finally:
            policy.train(was_training)
        return trajs

    def sample_for_env(self, sequences: list[list[int]], max_new_tokens: int, sampling: dict, eos_ids: list[int]):
        """An env's own recorded generate calls of this step, sampled by the decode loop on the copy this step's
        rollout sampled from (the weights do not change before the batch is scored): (ids, log-probs) per sequence,
        or None where that copy does not apply (no sampled rollout yet, other sampling settings or eos ids)."""
        if self._sampler is None or set(eos_ids) != set(self.eos_ids):
            return None
        model, used = self._sampler
        if any(sampling.get(k) != used.get(k) for k in ("do_sample", "temperature", "top_k", "top_p")):
            return None
        store = self._episode_caches
        found = store.find(sequences) if store is not None else [None] * len(sequences)
        snapshots = [None] * len(sequences) if store is not None else None
        with torch.no_grad():
            ids, logps = generate(model, sequences, max_new_tokens, sampling, self.eos_ids, self.pad_id, None,
                                  with_logprobs=True, caches=[f and f[1] for f in found], snapshots=snapshots)
        if store is not None:
            store.replace(found, [(s + i, snap.keep(len(i))) for s, i, snap in zip(sequences, ids, snapshots,
                                                                                   strict=True) if snap is not None])
        return ids, logps

    def release_episode_caches(self) -> None:
        """The step's episodes were scored: their KV caches are not needed any more (runner.py calls this)."""
        self._episode_caches = None

    def _start(self, prompt, row: dict) -> Trajectory:
        text, is_chat = render_prompt(self.tokenizer, prompt, self.tools)
        ids = self.tokenizer(text, add_special_tokens=not is_chat)["input_ids"]
        return Trajectory(prompt=prompt, row=row, prompt_ids=list(ids))

    def _start_sessions(self, trajs: list[Trajectory]) -> None:
        """Each episode's session (`env.start_episode`, concurrently under the runtime's rules: a failure fails that
        episode only); an opening the session extended is rendered again."""
        start = self._call_env(trajs, "start_episode", lambda t: self.env.start_episode(t.prompt, **t.row))
        for t, (opening, session) in start:
            t.messages.session = session
            if opening is not t.prompt:
                t.prompt, t.prompt_ids = opening, self._start(opening, t.row).prompt_ids

    def _assistant_turn(self, model, live: list[Trajectory], sampling: dict, prefix: "SharedPrefix",
                        turn_tokens: int, caches: dict[int, RowCache] | None = None, keep: bool = False,
                        keep_done: bool = False) -> None:
        """Turn k of every live episode, in one batched decode. With `caches`, each episode continues from its KV
        cache of the turn before (when it has one) and, with `keep` (a turn follows), leaves this turn's there; with
        `keep_done` also an episode's that ended here (the env's own calls may continue it, `sample_for_env`)."""
        limits = [min(turn_tokens, self.max_episode_tokens - len(t.completion_ids)) for t in live]
        contexts = [t.prompt_ids + t.completion_ids for t in live]
        with_logprobs = sampling.get("do_sample", False)
        snapshots = [None] * len(live) if caches is not None and keep else None
        if self.vllm is not None:
            new_ids, new_logps = self.vllm.generate(contexts, max(limits), sampling, self.eos_ids, with_logprobs)
        else:
            before = [caches.pop(id(t), None) for t in live] if caches is not None else None
            new_ids, new_logps = generate(model, contexts, max(limits), sampling, self.eos_ids, self.pad_id, prefix,
                                          with_logprobs=with_logprobs, caches=before, snapshots=snapshots)
        for i, (t, ids, logps, limit) in enumerate(zip(live, new_ids, new_logps, limits, strict=True)):
            ids, logps = ids[:limit], logps[:limit]
            t.completion_ids += ids
            t.env_mask += [1] * len(ids)
            t.logprobs += logps
            t.turns += 1
            t.messages.append({"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=True)})
            ended = bool(ids) and ids[-1] in self.eos_ids
            if len(t.completion_ids) >= self.max_episode_tokens or (limit < turn_tokens and not ended):
                t.done = t.cut = True  # the episode's token budget is spent
            if snapshots is not None and snapshots[i] is not None and (not t.done or keep_done):
                caches[id(t)] = snapshots[i].keep(len(ids))  # for its next turn (or the env's own calls)

    def _score_turn(self, live: list[Trajectory]) -> None:
        """The env's score of each live episode's last assistant turn (concurrently, under the runtime's rules); a
        call that fails, or a score that is not a finite real number, fails its episode."""
        live = [t for t in live if t.failure is None]
        if not self.score_turns:  # no score_turn: the turns share the episode's reward
            for t in live:
                t.turn_scores.append(0.0)
            return

        def score(t: Trajectory) -> float:
            return _as_turn_score(self.env.score_turn(_conversation(t), **t.row, **self._seed("score_turn", t)),
                                  self.env)

        for t, value in self._call_env(live, "score_turn", score):
            t.turn_scores.append(value)

    def _seed(self, method: str, t: Trajectory) -> dict:
        """`episode_seed=` for env.<method> where it declares one (runner.seed_kwargs), else nothing."""
        kwargs = getattr(self.runner, "seed_kwargs", None)
        return kwargs(method, t.messages.episode_seed) if kwargs is not None else {}

    def _call_env(self, live: list[Trajectory], method: str, call: Callable[[Trajectory], Any]) -> list[tuple]:
        """`call(t)` for each live episode, concurrently under the runtime's rules (runner.call_env); an episode
        whose call fails (or times out) is failed and done. Returns (episode, value) for the others."""
        outcomes = self.runner.call_env([lambda t=t: call(t) for t in live], method, [t.row for t in live],
                                        [t.text for t in live])
        done = []
        for t, (value, failure, seconds) in zip(live, outcomes, strict=True):
            t.seconds += seconds
            if failure is not None:
                t.failure, t.done = failure, True
            else:
                done.append((t, value))
        return done

    def _env_turn(self, live: list[Trajectory]) -> None:
        """The env's reply to each live episode, concurrently; an episode whose reply is None is done."""
        # a reply of the wrong type fails its episode (counted under the failure budget), like an exception
        def respond(t: Trajectory) -> list[dict] | None:
            session = t.messages.session
            reply = session.respond(_conversation(t)) if session is not None else self.env.respond(
                _conversation(t), **t.row, **self._seed("respond", t))
            return _as_messages(reply, self.env)

        for t, replies in self._call_env(live, "respond", respond):
            if replies is None:
                t.done = True
                continue
            text = env_turn_text(self.tokenizer, _conversation(t), replies, self.tools,
                                 ended_with_eos=bool(t.completion_ids) and t.completion_ids[-1] in self.eos_ids)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(t.completion_ids) + len(ids) >= self.max_episode_tokens:
                t.done = t.cut = True  # no room left for another assistant turn
                continue
            t.completion_ids += ids
            t.env_mask += [0] * len(ids)
            t.logprobs += [0.0] * len(ids)
            t.env_tokens += len(ids)
            t.messages.extend(replies)


def _check_template(rollout: "Rollout", prompt, model_name: str) -> None:
    opening = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    try:
        env_turn_text(rollout.tokenizer, [*opening, {"role": "assistant", "content": "ok"}],
                      {"role": "user", "content": "ok"}, rollout.tools, ended_with_eos=True)
    except Exception as e:
        raise ConfigError(f"{type(rollout.env).__qualname__} is multi-turn (it has respond), and model={model_name}'s "
                          f"chat template cannot append its turns: {e}") from e


def _conversation(t: Trajectory) -> list[dict]:
    return conversation(t.prompt, t.messages)


def conversation(prompt, messages: list[dict]) -> list[dict]:
    """What the env's respond and score_turn get: the opening (a prompt string is one user message) and the turns."""
    opening = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    return list(opening) + list(messages)


def _as_messages(reply, env) -> list[dict] | None:
    """The env's reply as a list of messages (several: e.g. one tool result per call), or None (done)."""
    if reply is None:
        return None
    if isinstance(reply, str):
        return [{"role": "user", "content": reply}]
    replies = reply if isinstance(reply, list) and reply else [reply]
    if all(isinstance(r, dict) and isinstance(r.get("content"), str) and r.get("role") in ("user", "tool")
           for r in replies):
        return [dict(r) for r in replies]
    raise TypeError(f"{type(env).__qualname__}.respond returned {reply!r}: return the env's reply as a string (a user "
                    "turn), a message {'role': 'user' | 'tool', 'content': str} or a non-empty list of them (e.g. one "
                    "tool result per call), or None when the episode is over.")


def _as_turn_score(value, env) -> float:
    number = as_real(value)
    if number is None or not math.isfinite(number):
        raise TypeError(f"{type(env).__qualname__}.score_turn returned {value!r}: return a finite real number (the "
                        "turn's reward, e.g. 0.1 for a useful tool call).")
    return number


def _as_list(value) -> list[int]:
    return [] if value is None else list(value) if isinstance(value, list | tuple) else [value]


class EpisodeCaches:
    """The KV caches of this step's episodes, for the env's own recorded calls (`Rollout.sample_for_env`): each
    episode's cache after its first reply, then after each call that continued it. A call whose input starts with an
    episode's tokens (a rebased call does, envs/recorder.py) feeds only what follows them instead of the whole
    conversation again; its own cache then stands for the episode. Caches are stored without their padding holes."""

    MIN_TOKENS = 16  # a shorter common start is not worth a cache

    def __init__(self, entries: list[tuple[list[int], RowCache]]):
        self.entries: list[tuple[torch.Tensor, RowCache]] = []  # (the tokens a cache holds, the cache)
        self.add(entries)

    def add(self, entries: list[tuple[list[int], RowCache]]) -> None:
        self.entries += [(torch.tensor(ids[: cache.tokens], dtype=torch.long), cache.compact())
                         for ids, cache in entries]

    def find(self, sequences: list[list[int]]) -> list[tuple[int, RowCache] | None]:
        """Per sequence, (entry index, the entry's cache cut to the tokens it shares with the sequence) of the entry
        sharing the longest start with it (at least MIN_TOKENS), or None."""
        found = []
        for s in sequences:
            s = torch.tensor(s, dtype=torch.long)
            best, best_n = None, self.MIN_TOKENS - 1
            for i, (ids, _) in enumerate(self.entries):
                n = min(len(ids), len(s))
                differ = (ids[:n] != s[:n]).nonzero()
                n = int(differ[0]) if len(differ) else n
                if n > best_n:
                    best, best_n = i, n
            found.append(None if best is None else (best, self.entries[best][1].truncated(best_n)))
        return found

    def replace(self, found: list[tuple[int, RowCache] | None], added: list[tuple[list[int], RowCache]]) -> None:
        """The caches a call left (its episodes continued) stored; an entry the call used whole gives way to them
        (one used in part, e.g. a shared opening, stays for the calls still to come)."""
        whole = {i for i, cache in filter(None, found) if cache.tokens >= self.entries[i][1].tokens}
        self.entries = [e for i, e in enumerate(self.entries) if i not in whole]
        self.add(added)


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
        with torch.no_grad():  # also when called on its own (tests)
            out = model(input_ids=torch.tensor([ids], device=model.device), use_cache=True)
        return cls(ids, getattr(out, "cache", None) or out.past_key_values)

    def covers(self, sequences: list[list[int]]) -> bool:
        n = len(self.ids)
        return all(len(s) > n and s[:n] == self.ids for s in sequences)

    def expanded(self, batch: int):
        return expand_cache(self.cache, batch)


def _common_prefix_length(sequences: list[list[int]]) -> int:
    first, n = sequences[0], min(len(s) for s in sequences)
    for i in range(n):
        if any(s[i] != first[i] for s in sequences[1:]):
            return i
    return n


def generate(model, sequences: list[list[int]], max_new_tokens: int, sampling: dict, eos_ids: list[int],
             pad_id: int, prefix: SharedPrefix | None = None, with_logprobs: bool = True,
             caches: "list[RowCache | None] | None" = None, snapshots: list | None = None
             ) -> tuple[list[list[int]], list[list[float]]]:
    """One batched generate over token-id sequences of different lengths. Returns, per sequence, the sampled
    ids up to and including its first eos, and their log-probabilities under the sampling temperature.

    With a shared prefix, every sequence is laid out as [prefix | left padding | its own tokens]: the prefix's
    KV cache is reused, and the holes are masked (positions come from the attention mask, so each token
    keeps the position it would have without padding). With `caches` (one `RowCache` per sequence, each holding
    a prefix of its sequence), the layout is [its cache | left padding | the tokens after it] and only those are
    fed (a None among them: that sequence is fed whole). `snapshots` (a list of Nones) is filled with each sequence's
    cache afterwards (`sampler.decode`)."""
    device = model.device
    if caches and any(c is not None for c in caches):  # a row without one: an empty cache (all its tokens fed)
        empty = next(c for c in caches if c is not None).empty()
        caches = [(c if c is not None else empty).truncated(len(s) - 1) for c, s in zip(caches, sequences, strict=True)]
        cache, head = cached_rows(caches)  # head: the mask over the cached columns
        tails = [s[c.tokens:] for c, s in zip(caches, sequences, strict=True)]
    elif prefix is not None and prefix.covers(sequences):
        cache, head = prefix.expanded(len(sequences)), torch.ones((len(sequences), len(prefix.ids)), dtype=torch.long)
        tails = [s[len(prefix.ids):] for s in sequences]
    else:
        cache, head, tails = None, torch.zeros((len(sequences), 0), dtype=torch.long), sequences
    start, width = head.size(1), max(len(t) for t in tails)
    ids = torch.full((len(tails), start + width), pad_id, dtype=torch.long)
    mask = torch.cat([head.to(torch.long).cpu(), torch.zeros((len(tails), width), dtype=torch.long)], dim=1)
    for i, tail in enumerate(tails):
        ids[i, start + width - len(tail):] = torch.tensor(tail)
        mask[i, start + width - len(tail):] = 1
    return decode(model, ids.to(device), mask.to(device), max_new_tokens, sampling, eos_ids, cache, start,
                  with_logprobs=with_logprobs, snapshots=snapshots)
