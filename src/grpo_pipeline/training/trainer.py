"""TRL's GRPOTrainer and the one thing the pipeline adds to it: rollouts the runtime generates.

`PipelineTrainer` keeps the dataset rows of the batch being generated (a multi-turn env's `respond` and
`score_episode` need the row's columns; TRL hands a `rollout_func` only the prompts). `rollout_func`
turns the runtime's trajectories into what TRL trains on: prompt ids, completion ids (assistant and env
turns), the env mask (env tokens carry no loss) and the sampled tokens' log-probabilities.
"""

import os
import statistics
import traceback
from contextlib import contextmanager

import torch
import trl
from trl import GRPOTrainer

from grpo_pipeline.config.grpo_args import CHECKPOINTING
from grpo_pipeline.envs.runner import as_real
from grpo_pipeline.rollout.turns import Rollout
from grpo_pipeline.training import dynamic_sampling as ds
from grpo_pipeline.training import prefix_logps
from grpo_pipeline.training.dynamic_sampling import loss_mask, reward_totals

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

    def __init__(self, *args, shared_prefix_loss: bool = False, train_completions: int | None = None,
                 resample_flat: int = 0, flat_negative: float = 0.0, rollout: Rollout | None = None,
                 ledger=None, record_episodes: bool = False, **kwargs):
        """GRPOTrainer's arguments, plus the pipeline's: `shared_prefix_loss` (training.shared_prefix_loss; on only
        for a model it is exact for), dynamic sampling (`train_completions`: completions trained per step when more
        are sampled; `resample_flat`, `flat_negative`), the runtime's `rollout` (how its samples relate to the
        policy: the log-probs of a copy in another dtype or of vLLM are the behaviour policy's; vLLM's LoRA kernels
        get TRL's importance-sampling correction) and the episode ledger (`ledger` on the main process;
        `record_episodes` on every process, rows are gathered from all)."""
        super().__init__(*args, **kwargs)
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
        if self.behaviour_logps and torch.is_grad_enabled():  # the loss' forward, not a no-grad reference pass
            self._loss_logps = logps.detach()
        return logps

    def _compute_loss(self, model, inputs):
        """TRL's loss; with behaviour log-probs, also how far the sampler's log-probs are from the trainer's on the
        tokens trained (TRL's sampling/sampling_logp_difference/*, as for vLLM)."""
        self._loss_logps = None
        loss = super()._compute_loss(model, inputs)
        sampled = inputs.get("sampling_per_token_logps")
        if self.behaviour_logps and self._loss_logps is not None and sampled is not None:
            mask = loss_mask(inputs)
            gap = (self._loss_logps - sampled).abs() * mask
            metrics = self._metrics["train"]
            metrics["sampling/sampling_logp_difference/mean"].append((gap.sum() / mask.sum().clamp(min=1)).item())
            metrics["sampling/sampling_logp_difference/max"].append(gap.max().item())
        return loss

    def _generate_and_score_completions(self, inputs):
        training = self.model.training
        out, logs = self._sample_round(inputs)
        rounds = [(inputs, logs)]
        spread = None
        if self.train_completions is not None and training:
            if self.resample_flat:
                out, spread, extra = self._resample_flat_groups(inputs, out, logs)
                if extra is not None:
                    rounds.append(extra)
            out = self._keep_groups_with_spread(out, spread, logs)
        if self.record_episodes and training:
            from accelerate.utils import gather_object

            for batch, batch_logs in rounds:
                rows = gather_object([{k: v for k, v in x.items() if k != "prompt"} for x in batch])  # as TRL does
                if self.ledger is not None:
                    self._record_episodes(rows, batch_logs)
        return out

    def _sample_round(self, inputs) -> tuple[dict, dict]:
        """TRL generates and scores `inputs`; returns its output and a copy of what it logged for this batch alone."""
        self.current_rows = inputs
        for value in self._logs.values():  # TRL keeps the last completions here; we want this batch's alone
            value.clear()
        out = super()._generate_and_score_completions(inputs)
        if self.behaviour_logps and "sampling_per_token_logps" in out:
            # the samples came from the runtime's bf16 (or other dtype) copy: PPO's ratio is the policy's probability
            # over the one that really sampled, so the clip also bounds the sampler's mismatch; costs no forward pass
            out["old_per_token_logps"] = out["sampling_per_token_logps"]
        logs = {k: ({n: list(v) for n, v in self._logs[k].items()} if isinstance(self._logs[k], dict)
                    else list(self._logs[k])) for k in ("prompt", "completion", "rewards", "advantages", "extra")}
        return out, logs

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
        self.ledger.record("train", self.state.global_step + 1, list(logs["prompt"]), completions, rewards,
                           totals=totals, advantages=list(logs["advantages"]), rows=rows,
                           seconds=list(extra["seconds"]) if "seconds" in extra else None,
                           failures=list(extra["failure"]) if "failure" in extra else None,
                           transcripts="transcript" in extra)


def _batch_totals(trainer, logs: dict, n: int) -> list[float | None] | None:
    """The reward totals (reward_totals) of the n completions TRL logged in `logs`, or None where they cannot be
    read so: logs of another batch, or normalize_then_sum (its advantages are not a group's reward spread)."""
    rewards = logs.get("rewards") or {}
    aggregation = getattr(getattr(trainer, "args", None), "multi_objective_aggregation", "sum_then_normalize")
    if not rewards or any(len(c) != n for c in rewards.values()) or aggregation != "sum_then_normalize":
        return None
    return reward_totals(rewards, trainer.reward_weights.tolist())


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


def rollout_func(rollout: Rollout, sampling: dict, extra_columns: list[str]):
    def run(prompts: list, trainer: PipelineTrainer) -> dict:
        rows = [{k: x[k] for k in extra_columns} for x in trainer.current_rows]
        policy = trainer.accelerator.unwrap_model(trainer.model)
        trajs = rollout.run(policy, prompts, rows, sampling)
        out = {
            "prompt_ids": [t.prompt_ids for t in trajs],
            "completion_ids": [t.completion_ids for t in trajs],
            "logprobs": [t.logprobs for t in trajs],
        }
        if not rollout.multi_turn:  # TRL decodes the completion and scores it as text
            return out
        metrics = trainer._metrics["train" if trainer.model.training else "eval"]  # averaged and logged per step
        for key, value in episode_metrics(rollout, trajs).items():
            metrics[key].append(value)
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
