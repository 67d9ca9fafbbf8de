"""TRL's GRPOTrainer and the one thing the pipeline adds to it: rollouts the runtime generates.

`PipelineTrainer` keeps the dataset rows of the batch being generated (a multi-turn env's `respond` and
`score_episode` need the row's columns; TRL hands a `rollout_func` only the prompts). `rollout_func`
turns the runtime's trajectories into what TRL trains on: prompt ids, completion ids (assistant and env
turns), the env mask (env tokens carry no loss) and the sampled tokens' log-probabilities. The turns a seed-style
env sampled inside `score_episode` (recorded by the runner) join the batch as rows of their own (turn_samples.py).
"""

import os
import statistics
import traceback
from contextlib import contextmanager

import torch
import trl
from trl import GRPOTrainer
from trl.trainer.utils import use_adapter

from grpo_pipeline.config.grpo_args import CHECKPOINTING
from grpo_pipeline.envs.runner import as_real
from grpo_pipeline.rollout.turns import Rollout
from grpo_pipeline.training import dynamic_sampling as ds
from grpo_pipeline.training import prefix_logps
from grpo_pipeline.training.dynamic_sampling import loss_mask, reward_totals
from grpo_pipeline.training.turn_credit import per_token_advantages, turn_segments
from grpo_pipeline.training.turn_samples import chained, turn_rows

TESTED_TRL = "1.16"  # PipelineTrainer overrides private GRPOTrainer methods: the minor version it was tested on


def check_trl(version: str) -> None:
    if version.split(".")[:2] != TESTED_TRL.split("."):
        raise ImportError(
            f"grpo_pipeline needs TRL {TESTED_TRL}.x, and TRL {version} is installed: PipelineTrainer overrides "
            f"private GRPOTrainer methods that change between TRL minor versions. Install the tested one: "
            f"pip install 'trl>={TESTED_TRL},<{TESTED_TRL.split('.')[0]}.{int(TESTED_TRL.split('.')[1]) + 1}'.")


check_trl(trl.__version__)

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL 1.16; we pin and test it


class PipelineTrainer(GRPOTrainer):
    current_rows: list[dict] = []
    record_episodes = False  # the episode ledger is on (set on every process: rows are gathered from all)
    ledger = None  # the episode ledger (tracking/ledger.py), main process only
    shared_prefix_loss = False  # training.shared_prefix_loss and a model it is exact for (prefix_logps.supported)
    train_completions: int | None = None  # dynamic sampling (generation.oversample > 1): completions trained per step
    resample_flat = 0  # generation.resample_flat: more samples for a flat group below the batch's best
    flat_negative = 0.0  # generation.flat_negative: free slots go to flat groups below the step's mean, pushed down
    # the runtime samples from a copy in another dtype (runtime.generation_dtype), or from vLLM holding the policy's
    # weights (vllm.weight_sync=weights): the sampled tokens' log-probs are the behaviour policy's
    behaviour_logps = False
    _loss_logps = None  # the trainer's log-probs of the batch being trained (for sampling/* metrics)
    logp_watch = None  # sentinel.*: a LogpGapWatch (rollout/sentinel.py)

    def __init__(self, *args, shared_prefix_loss: bool = False, train_completions: int | None = None,
                 resample_flat: int = 0, flat_negative: float = 0.0, rollout: Rollout | None = None,
                 ledger=None, record_episodes: bool = False, runner=None, turn_credit: bool = False,
                 logp_watch=None, **kwargs):
        """GRPOTrainer's arguments, plus the pipeline's: `shared_prefix_loss` (training.shared_prefix_loss; on only
        for a model it is exact for), dynamic sampling (`train_completions`: completions trained per step when more
        are sampled; `resample_flat`, `flat_negative`), the runtime's `rollout` (how its samples relate to the
        policy: the log-probs of a copy in another dtype or of vLLM are the behaviour policy's; vLLM's LoRA kernels
        get TRL's importance-sampling correction) and the episode ledger (`ledger` on the main process;
        `record_episodes` on every process, rows are gathered from all) and the env's `runner`, whose recorded
        samples of the env's own generate calls join the batch as rows (runtime.train_env_calls); `turn_credit`:
        each assistant turn of a multi-turn episode gets its own advantage (runtime.turn_credit=turn)."""
        super().__init__(*args, **kwargs)
        self.runner, self.turn_credit = runner, turn_credit
        self.logp_watch = logp_watch  # sentinel: the sampler's vs the trainer's log-probs (rollout/sentinel.py)
        self._turns: list = []  # the step's recorded samples, per episode row of its rounds (turn_samples.py)
        self._turns_skipped = self._turns_rebased = 0
        self.shared_prefix_loss = shared_prefix_loss and prefix_logps.supported(self.model)
        self.train_completions, self.resample_flat, self.flat_negative = train_completions, resample_flat, flat_negative
        self.ledger, self.record_episodes = ledger, record_episodes
        if rollout is not None and rollout.uses_vllm and rollout.vllm_sync == "adapter":
            self.correct_sampler_mismatch()  # vLLM's LoRA kernels: TRL's correction, one more forward a step
        elif rollout is not None and (rollout.uses_vllm or (rollout.sampler is not None
                                                            and rollout.sampler.differs(self.model))):
            self.behaviour_logps = True  # vLLM with the policy's own weights, or a copy in another dtype

    def correct_sampler_mismatch(self) -> None:
        """Rollouts come from the runtime's vLLM engine serving the adapter through its LoRA kernels
        (vllm.weight_sync=adapter): switch on TRL's importance-sampling correction for vLLM samples (sequence_mask,
        clip 3 by default; it recomputes the old log-probs with one more forward over every sampled completion) and
        its sampling/* metrics. TRL gates them on use_vllm; its weight sync becomes a no-op, since the runtime hands
        vLLM the adapter before every rollout."""
        self.use_vllm = True
        self.vllm_generation = _RuntimeSyncsWeights()
        self._last_loaded_step = -1

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **inputs):
        prefix = 0
        if (self.shared_prefix_loss and not compute_aux_loss and self.accelerator.num_processes == 1
                and not getattr(self.args, CHECKPOINTING) and all(v is None for v in inputs.values())):
            prefix = prefix_logps.shared_prefix_length(input_ids, attention_mask, input_ids.size(1) - logits_to_keep)
        if prefix < prefix_logps.MIN_PREFIX:
            logps, entropies, aux = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **inputs)
            return self._seen(logps), entropies, aux
        logps, entropies = prefix_logps.per_token_logps(model, input_ids, attention_mask, logits_to_keep, prefix,
                                                        compute_entropy, batch_size or input_ids.size(0),
                                                        self.accelerator.autocast)
        return self._seen(logps), entropies, None

    def _seen(self, logps):
        # the loss' forward, not a no-grad reference pass
        if (self.behaviour_logps or self.logp_watch is not None) and torch.is_grad_enabled():
            self._loss_logps = logps.detach()
        return logps

    def _compute_loss(self, model, inputs):
        """TRL's loss; with behaviour log-probs, also how far the sampler's log-probs are from the trainer's on the
        tokens trained (TRL's sampling/sampling_logp_difference/*, as for vLLM)."""
        self._loss_logps = None
        loss = super()._compute_loss(model, inputs)
        sampled = inputs.get("sampling_per_token_logps")
        if self._loss_logps is not None and sampled is not None:
            mask = loss_mask(inputs)
            gap = (self._loss_logps - sampled).abs() * mask
            mean, peak = (gap.sum() / mask.sum().clamp(min=1)).item(), gap.max().item()
            metrics = self._metrics["train"]
            if self.behaviour_logps:
                metrics["sampling/sampling_logp_difference/mean"].append(mean)
                metrics["sampling/sampling_logp_difference/max"].append(peak)
            if self.logp_watch is not None:
                metrics["sentinel/logp_gap_max"].append(peak)
                self.logp_watch.observe(peak, mean, self.state.global_step + 1)
        return loss

    def _generate_and_score_completions(self, inputs):
        training = self.model.training
        self._turns, self._turns_skipped, self._turns_rebased = [], 0, 0
        out, logs = self._sample_round(inputs)
        rounds = [(inputs, logs)]
        spread = None
        if self.train_completions is not None and training:
            if self.resample_flat:
                out, spread, extra = self._resample_flat_groups(inputs, out, logs)
                if extra is not None:
                    rounds.append(extra)
            if "turn_advantages" in out:  # per-turn credit: a group teaches when any of its turns has an advantage
                spread = ds.spread_of_groups(None, out["turn_advantages"].abs().amax(dim=1), self.num_generations)
            out = self._keep_groups_with_spread(out, spread, logs)
        if "turn_episode" in out:
            out = self._with_turn_rows(out)
        if "turn_advantages" in out:  # per-turn credit: the loss takes [rows, tokens] advantages (TRL 1.16 does)
            out["advantages"] = out.pop("turn_advantages")
        if self.record_episodes and training:
            from accelerate.utils import gather_object

            for batch, batch_logs in rounds:
                rows = gather_object([{k: v for k, v in x.items() if k not in ("prompt", *ROLLOUT_FIELDS)}
                                      for x in batch])  # as TRL does, less the fields rollout_func added to the rows
                if self.ledger is not None:
                    self._record_episodes(rows, batch_logs)
        if self.beta != 0.0:  # the KL term's reference log-probs, once for each row trained (_reference_deferred)
            out["ref_per_token_logps"] = self._teacher_forced(out, reference=True, training=training)
        return out

    def _sample_round(self, inputs) -> tuple[dict, dict]:
        """TRL generates and scores `inputs`; returns its output and a copy of what it logged for this batch alone."""
        self.current_rows = inputs
        for value in self._logs.values():  # TRL keeps the last completions here; we want this batch's alone
            value.clear()
        if self.runner is not None:
            self.runner.last_batch.pop("turn_samples", None)  # the runner replaces last_batch when it scores
        with _reference_deferred(self):
            out = super()._generate_and_score_completions(inputs)
        last = self.runner.last_batch if self.runner is not None else {}
        turns = last.get("turn_samples")
        n = out["advantages"].size(0)
        # one process: the rows added differ per process, and their extra forwards would mismatch the collectives
        if self.model.training and turns is not None and len(turns) == n and self.accelerator.num_processes == 1:
            # tag each row with its episode: dynamic sampling selects and reorders rows, the tag goes with them
            out["turn_episode"] = torch.arange(len(self._turns), len(self._turns) + n, device=out["advantages"].device)
            self._turns += turns
            self._turns_skipped += last.get("turn_samples_skipped", 0)
            self._turns_rebased += last.get("turn_calls_rebased", 0)
        if self.behaviour_logps and "sampling_per_token_logps" in out:
            # the samples came from the runtime's bf16 (or other dtype) copy: PPO's ratio is the policy's probability
            # over the one that really sampled, so the clip also bounds the sampler's mismatch; costs no forward pass
            out["old_per_token_logps"] = out["sampling_per_token_logps"]
        logs = {k: ({n: list(v) for n, v in self._logs[k].items()} if isinstance(self._logs[k], dict)
                    else list(self._logs[k])) for k in ("prompt", "completion", "rewards", "advantages", "extra")}
        if self.mask_truncated_completions and self.model.training:
            # the ledger: episodes TRL kept out of the loss whole (cut by the token budget: no EOS at the end; for a
            # multi-turn episode, its last turn's), though they still count in their group's baseline
            logs["masked"] = self.accelerator.gather((out["completion_mask"].sum(dim=1) == 0).int()).tolist()
        if self.turn_credit and self.model.training and "tool_mask" in out:
            out["turn_advantages"] = self._turn_advantages(out, inputs, logs)
            logs["turns"] = [{"score": row.get("turn_scores"),
                              "advantage": [round(a[s].item(), 4) for s, _ in turn_segments(m.tolist())]}
                             for row, a, m in zip(inputs, out["turn_advantages"], out["tool_mask"], strict=True)]
        elif "turn_episode" in out:  # the ledger: how many turns the env sampled itself in each episode
            logs["turns"] = [{"sampled": len(t)} for t in turns]
        return out, logs

    def _turn_advantages(self, out: dict, inputs: list[dict], logs: dict) -> torch.Tensor:
        """Per-token advantages, each assistant turn its own (training/turn_credit.py), from the episodes' reward
        totals and the env's turn scores the rollout put in each row."""
        n = out["advantages"].size(0)
        totals = _batch_totals(self, logs, n)
        if totals is None:
            raise RuntimeError("runtime.turn_credit=turn needs this batch's rewards per completion, which TRL logged "
                               "for several processes at once; run on one process or use runtime.turn_credit=episode.")
        return per_token_advantages(totals, [row.get("turn_scores") for row in inputs], out["tool_mask"],
                                    self.num_generations, str(self.scale_rewards))

    def _with_turn_rows(self, out: dict) -> dict:
        """The batch with a row for every turn the env sampled in the episodes it trains (training/turn_samples.py),
        each with its episode's advantage. The old log-probs TRL computed for the other rows before scoring are
        computed for these with the same model (the reference ones, for every row, at the end: _reference_deferred);
        vLLM's importance-sampling ratio is 1 (the env's calls sampled from the policy itself)."""
        index = out.pop("turn_episode").tolist()
        metrics = self._metrics["train"]
        pad = self._tokenizer.pad_token_id or 0
        samples = [self._turns[i] for i in index]
        out, rest, grown = self._chained(out, samples, pad)
        metrics["env/turn_samples_chained"].append(float(sum(map(len, samples)) - sum(map(len, rest))))
        rows = turn_rows(rest, out["advantages"], pad, self.mask_truncated_completions)
        metrics["env/turn_samples"].append(0.0 if rows is None else float(rows["advantages"].size(0)))
        metrics["env/turn_samples_skipped"].append(float(self._turns_skipped))
        metrics["env/turn_calls_rebased"].append(float(self._turns_rebased))
        if rows is None:
            return out
        if "old_per_token_logps" in out:
            rows["old_per_token_logps"] = (rows["sampling_per_token_logps"] if self.behaviour_logps
                                           else self._teacher_forced(rows))
        if "importance_sampling_ratio" in out:
            ratio = out["importance_sampling_ratio"]
            width = 1 if ratio.size(1) == 1 else rows["completion_ids"].size(1)
            rows["importance_sampling_ratio"] = torch.ones((rows["advantages"].size(0), width), device=ratio.device)
        if "tool_mask" in out:
            rows["tool_mask"] = torch.ones_like(rows["completion_mask"])
        if "turn_advantages" in out:  # a turn the env sampled itself: its episode's advantage on every token
            rows["turn_advantages"] = rows["advantages"][:, None].expand_as(rows["completion_mask"]).clone()
        if "sampling_per_token_logps" not in out:
            del rows["sampling_per_token_logps"]
        n = out["advantages"].size(0)
        rows = _padded_to_multiple(rows, n + rows["advantages"].size(0), self.args.steps_per_generation)
        missing = [k for k, v in out.items() if torch.is_tensor(v) and v.dim() > 0 and v.size(0) == n and k not in rows]
        if missing:
            raise NotImplementedError(f"training an env's own generate calls with {missing} in TRL's batch is not "
                                      "supported; set runtime.train_env_calls=false")
        both = ds.concat_outputs(out, rows, self._tokenizer.pad_token_id or 0)
        both["num_items_in_batch"] = out["num_items_in_batch"] + loss_mask(rows).sum()  # one process (above)
        return both

    def _chained(self, out: dict, samples: list, pad: int) -> tuple[dict, list, list[int]]:
        """`out` with the samples that continue their episode's row token-exactly appended to it
        (training/turn_samples.py `chained`), and the old log-probs of the rows that grew."""
        new, rest, grown = chained(out, samples, pad, self.mask_truncated_completions)
        if not grown:
            return out, rest, grown
        sub = {k: new[k][grown] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
        if "old_per_token_logps" in new:
            if self.behaviour_logps and "sampling_per_token_logps" in new:
                new["old_per_token_logps"] = new["sampling_per_token_logps"]
            else:
                new["old_per_token_logps"][grown] = self._teacher_forced(sub)
        new["num_items_in_batch"] = out["num_items_in_batch"] + loss_mask(new).sum() - loss_mask(out).sum()
        return new, rest, grown

    def _teacher_forced(self, rows: dict, reference: bool = False, training: bool = True) -> torch.Tensor:
        """Per-token log-probs of rows' completions under the policy (or the reference model), as TRL computes them."""
        ids = torch.cat([rows["prompt_ids"], rows["completion_ids"]], dim=1)
        mask = torch.cat([rows["prompt_mask"], rows["completion_mask"]], dim=1)
        keep = rows["completion_ids"].size(1)
        size = self.args.per_device_train_batch_size if training else self.args.per_device_eval_batch_size
        with torch.no_grad():
            if not reference:
                return self._get_per_token_logps_and_entropies(self.model, ids, mask, keep, size)[0]
            if self.ref_model is not None:
                return self._get_per_token_logps_and_entropies(self.ref_model, ids, mask, keep, size)[0]
            model = self.accelerator.unwrap_model(self.model)
            with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
                return self._get_per_token_logps_and_entropies(self.model, ids, mask, keep, size)[0]

    def _resample_flat_groups(self, inputs, out: dict, logs: dict):
        """Adaptive sampling for flat groups (training/dynamic_sampling.py): when the first round leaves the step
        short of groups with reward spread, the flat groups that scored below the batch's best get `resample_flat`
        more completions of the same prompt (one more TRL generation round, whose own metrics are not logged). A
        group whose completions now differ is trained on a balanced `num_generations` of all its samples. Returns
        the output (same rows, resampled groups swapped in), the groups with spread (None where no rewards could be
        read: dynamic sampling then reads the advantages), and the extra round (inputs, logs) or None."""
        size = self.num_generations
        n = out["advantages"].size(0)
        totals = _batch_totals(self, logs, n)
        if totals is None:  # no rewards to read flatness from: dynamic sampling reads the advantages
            return out, None, None
        spread = ds.spread_of_groups(totals, out["advantages"], size)
        need = self.train_completions // size - sum(spread)
        if need <= 0 or all(t is None for t in totals):
            return out, spread, None
        extra = self.resample_flat
        # TRL's logs hold one batch's worth
        chosen = ds.flat_groups_to_resample(totals, spread, size, need, self.args.generation_batch_size // extra)
        metrics = self._metrics["train"]
        metrics["dynamic_sampling/groups_resampled"].append(float(len(chosen)))
        if not chosen:
            metrics["dynamic_sampling/groups_rescued"].append(0.0)
            return out, spread, None
        more = [dict(inputs[g * size]) for g in chosen for _ in range(extra)]  # TRL writes rollout fields into rows
        with _metrics_kept(metrics):  # the extra round's own TRL metrics would skew the step's
            out2, logs2 = self._sample_round(more)
        totals2 = _batch_totals(self, logs2, len(more))
        if totals2 is None:  # not scored as the first round was (cannot happen with one reward setup)
            metrics["dynamic_sampling/groups_rescued"].append(0.0)
            return out, spread, (more, logs2)
        both = ds.concat_outputs(out, out2, self._tokenizer.pad_token_id or 0)
        rows, advantages, rescued = ds.rescue_groups(totals, totals2, chosen, size, extra, both["advantages"],
                                                     self.scale_rewards)
        for g in rescued:
            spread[g] = True
        metrics["dynamic_sampling/groups_rescued"].append(float(len(rescued)))
        logs["advantages"] = advantages[:n].tolist()  # the ledger shows the advantages the union gave
        logs2["advantages"] = advantages[n:].tolist()
        both["advantages"] = advantages
        return ds.select_rows(both, torch.tensor(rows, device=advantages.device)), spread, (more, logs2)

    def _keep_groups_with_spread(self, out: dict, spread: list[bool] | None = None, logs: dict | None = None) -> dict:
        """Dynamic sampling (training/dynamic_sampling.py): of the groups sampled, keep (in sampling order) up to
        train_completions' worth whose rewards differ; with `flat_negative`, slots still free go to flat groups that
        scored below the step's mean; if nothing is kept, one flat group with its advantages set to 0. The loss
        normalizer is recounted for the rows kept. `logs`: what TRL logged for this batch (default: its current
        logs); the ledger's advantages there are updated to the ones trained."""
        size = self.num_generations
        advantages = out["advantages"]
        n = advantages.size(0)
        totals = _batch_totals(self, logs if logs is not None else getattr(self, "_logs", {}), n)
        if spread is None:
            spread = ds.spread_of_groups(totals, advantages, size)
        cap = self.train_completions // size
        negative = {}
        if self.flat_negative:
            negative = ds.negative_flat_groups(totals, spread, size, cap - min(cap, sum(spread)), self.flat_negative,
                                               self.scale_rewards)
            if logs is not None and len(logs.get("advantages", ())) == n:
                for g, values in negative.items():  # the ledger shows the advantages trained on
                    logs["advantages"][g * size:(g + 1) * size] = values
        kept = ds.keep_groups(advantages, spread, size, cap, negative)
        out = ds.select_rows(out, kept.rows)
        out["advantages"] = kept.advantages
        if "turn_advantages" in out and not kept.trained + kept.negative:  # nothing kept: the flat group trains nothing
            out["turn_advantages"] = torch.zeros_like(out["turn_advantages"])
        out["num_items_in_batch"] = ds.loss_mask(out).sum()
        metrics = self._metrics["train"]
        metrics["dynamic_sampling/groups_sampled"].append(float(len(spread)))
        metrics["dynamic_sampling/groups_trained"].append(float(kept.trained))
        if self.flat_negative:
            metrics["dynamic_sampling/groups_negative"].append(float(kept.negative))
        return out

    def _record_episodes(self, rows: list[dict], logs: dict) -> None:
        """A generation batch (all processes, gathered; logs: what TRL logged for it) into the ledger. With
        steps_per_generation > 1 one generation serves several steps: its episodes carry the first of them."""
        rewards = {name: list(values) for name, values in logs["rewards"].items()}
        totals = reward_totals(rewards, self.reward_weights.tolist()) if rewards else None
        extra = logs["extra"]
        completions = list(extra["transcript"]) if "transcript" in extra else list(logs["completion"])
        prompts = list(extra["opening"]) if "opening" in extra else list(logs["prompt"])  # as the episode began
        self.ledger.record("train", self.state.global_step + 1, prompts, completions, rewards,
                           totals=totals, advantages=list(logs["advantages"]), rows=rows,
                           seconds=list(extra["seconds"]) if "seconds" in extra else None,
                           failures=list(extra["failure"]) if "failure" in extra else None,
                           transcripts="transcript" in extra, turns=logs.get("turns"), masked=logs.get("masked"))


def _padded_to_multiple(rows: dict, total: int, multiple: int) -> dict:
    """`rows` with rows that train nothing (a copy of the first, its mask 0, advantage 0) appended so that the
    batch's `total` rows split evenly into TRL's `multiple` (steps_per_generation) chunks: TRL's split would drop
    the remainder, tokens the loss normaliser counts."""
    extra = -total % multiple
    if not extra:
        return rows
    filler = {k: v[:1].expand(extra, *v.shape[1:]).clone() for k, v in rows.items()}
    filler["completion_mask"] = torch.zeros_like(filler["completion_mask"])
    filler["advantages"] = torch.zeros_like(filler["advantages"])
    if "turn_advantages" in filler:
        filler["turn_advantages"] = torch.zeros_like(filler["turn_advantages"])
    return {k: torch.cat([v, filler[k]]) for k, v in rows.items()}


def _batch_totals(trainer, logs: dict, n: int) -> list[float | None] | None:
    """The reward totals (reward_totals) of the n completions TRL logged in `logs`, or None where they cannot be
    read so: logs of another batch, or normalize_then_sum (its advantages are not a group's reward spread)."""
    rewards = logs.get("rewards") or {}
    aggregation = getattr(getattr(trainer, "args", None), "multi_objective_aggregation", "sum_then_normalize")
    if not rewards or any(len(c) != n for c in rewards.values()) or aggregation != "sum_then_normalize":
        return None
    return reward_totals(rewards, trainer.reward_weights.tolist())


@contextmanager
def _reference_deferred(trainer):
    """TRL computes the reference log-probs of every row it samples before the rows are scored. The pipeline then
    drops rows (dynamic sampling), grows rows (an env's turns chained onto its episode's row) and adds rows (the
    env's own turns): the reference log-probs are computed once, for the rows trained, at the end of
    `_generate_and_score_completions`. TRL reads `beta` there only to decide whether to compute them."""
    beta, trainer.beta = trainer.beta, 0.0
    try:
        yield
    finally:
        trainer.beta = beta


@contextmanager
def _metrics_kept(metrics: dict):
    """What TRL appends to `metrics` inside is dropped: the step's metrics stay those of its first round."""
    logged = {k: len(v) for k, v in metrics.items()}
    try:
        yield
    finally:
        for key in list(metrics):
            if key not in logged:
                del metrics[key]
            else:
                del metrics[key][logged[key]:]


class _RuntimeSyncsWeights:
    def sync_weights(self) -> None:  # TRL calls this before each rollout; rollout/vllm_engine.py already synced
        pass


# what rollout_func adds to each row for the reward functions (TRL merges them into the batch's rows)
ROLLOUT_FIELDS = ("transcript", "episode_failure", "turn_scores", "opening", "episode_ids")


def rollout_func(rollout: Rollout, sampling: dict, extra_columns: list[str]):
    def run(prompts: list, trainer: PipelineTrainer) -> dict:
        rows = [{k: x[k] for k in extra_columns} for x in trainer.current_rows]
        policy = trainer.accelerator.unwrap_model(trainer.model)
        trajs = rollout.run(policy, prompts, rows, sampling, step=trainer.state.global_step + 1)
        for key, value in rollout.sentinel_metrics.items():  # the sampler checked against the policy
            trainer._metrics["train"][key].append(value)
        out = {
            "prompt_ids": [t.prompt_ids for t in trajs],
            "completion_ids": [t.completion_ids for t in trajs],
            "logprobs": [t.logprobs for t in trajs],
        }
        if not rollout.multi_turn:  # TRL decodes the completion and scores it as text; the env's own calls may
            # continue the episode from its tokens as sampled (envs/recorder.py `rebased`)
            return out | {"episode_ids": [list(t.prompt_ids) + list(t.completion_ids) for t in trajs]}
        if rollout.turn_credit:
            out["turn_scores"] = [t.turn_scores for t in trajs]
        metrics = trainer._metrics["train" if trainer.model.training else "eval"]  # averaged and logged per step
        for key, value in episode_metrics(rollout, trajs).items():
            metrics[key].append(value)
        if rollout.stateful:  # a session extended the opening (a TRL env's reset() text): the ledger shows it
            out["opening"] = [t.prompt for t in trajs]
        return out | {
            "env_mask": [t.env_mask for t in trajs],
            "transcript": [t.messages for t in trajs],  # what score_episode gets as `completion`
            "episode_failure": [t.failure for t in trajs],
        }

    return run


def _env_metrics(extra, traj, env) -> dict[str, float] | None:
    """The env's episode_metrics for one episode; one that raises or returns no {name: number} fails that episode
    (scored as a failure under the failure budget), not the run."""
    name = f"{type(env).__qualname__}.episode_metrics"
    try:
        values = extra(traj.messages, **traj.row)
        if not isinstance(values, dict) or not all(isinstance(k, str) and as_real(v) is not None
                                                   for k, v in values.items()):
            raise TypeError(f"returned {values!r}: return a dict of metric name -> number")
        return {k: as_real(v) for k, v in values.items()}
    except Exception as e:
        traj.failure = f"{name} raised:\n" + "".join(traceback.format_exception(e)).rstrip() + f"\nrow: {traj.row}"
        return None


def episode_metrics(rollout: Rollout, trajs: list) -> dict[str, float]:
    """Per-batch means: assistant turns, env tokens, episodes cut by the token budget, and whatever the env's
    optional `episode_metrics(transcript, **row)` reports (e.g. tool calls)."""
    out = {
        "env/turns_mean": statistics.fmean(t.turns for t in trajs),
        "env/env_tokens_mean": statistics.fmean(t.env_tokens for t in trajs),
        "env/episodes_cut": float(sum(t.cut for t in trajs)),
        "env/respond_seconds_max": max(t.seconds for t in trajs),
    }
    extra = getattr(rollout.env, "episode_metrics", None)
    if callable(extra):
        values = [v for t in trajs if t.failure is None and (v := _env_metrics(extra, t, rollout.env)) is not None]
        for key in sorted({k for v in values for k in v}):
            out[f"env/{key}"] = statistics.fmean(float(v.get(key, 0.0)) for v in values)
    return out
