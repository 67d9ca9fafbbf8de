"""Rollouts through vLLM (`vllm=colocate`): the runtime's turns sampled by an in-process `vllm.LLM`.

The runtime still owns the episode (turns, env replies, masks, the trajectory TRL trains on); vLLM only
continues token sequences, exactly as the HF decode loop does: token ids in, sampled ids and their log-probs
(after temperature, as TRL computes them) out, so nothing is decoded and re-encoded. vLLM's automatic prefix
caching reuses the KV cache of what sequences share (the system prompt, a worked example, earlier turns).

How the policy reaches vLLM before every rollout (`vllm.weight_sync`), so vLLM never samples a stale policy:
- `weights`: the policy's weights (LoRA merged into them, W + BA, from the runtime's merged copy) are loaded into
  the engine in place through vLLM's own `reload_weights` (the layer-wise reload that re-runs each layer's
  post-load processing: on a CPU, the oneDNN packing of every linear layer), then its prefix cache is reset (its
  keys and values came from the old weights). Every weight is pushed, so no fused vLLM layer (qkv_proj,
  gate_up_proj) is ever loaded in part. Decoding then costs what the base model costs. Works for full
  fine-tuning too. (TRL's colocate sync, `model.load_weights` on the packed model, fails on the CPU build:
  `'Parameter' object has no attribute 'weight_loader'`: vLLM's CPU linear layers drop their weights after
  packing them, which `reload_weights` restores first.)
- `adapter` (LoRA only): the adapter, saved after every update and handed to vLLM as a new `LoRARequest`
  (vLLM's multi-LoRA kernels apply it per token).

vLLM's log-probs differ a little from the trainer's (other kernels). With `weights` the loss takes them as the
behaviour policy's (PPO's ratio over what really sampled, no extra forward); with `adapter` TRL's importance-sampling
correction for vLLM rollouts is switched on (recipe.py, training/trainer.py). `sampling/sampling_logp_difference/*` shows the gap.
"""

import logging
import os
import shutil
import tempfile
from pathlib import Path

from grpo_pipeline.config.schema import WeightSync
from grpo_pipeline.errors import ConfigError


class VllmBackend:
    def __init__(self, model_path: str, *, dtype: str, max_model_len: int, sync: str, lora_rank: int | None,
                 gpu_memory_utilization: float, seed: int):
        import torch

        from grpo_pipeline.rollout.policy_copy import MergedCopy

        threads = torch.get_num_threads()
        # the engine in this process: no IPC per step, and the weight push hands it tensors, not copies
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on a CPU (default 4)
        # vLLM would pin this process's threads to cores and drop torch to 1 thread "for serving": the trainer
        # shares the process and needs its threads
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        try:
            from vllm import LLM
        except ImportError as e:
            raise ConfigError(f"vllm=colocate needs vLLM ({e}). On a CPU machine: make install-vllm (the CPU build, "
                              "in .venv-vllm); on GPUs: pip install '.[vllm]'.") from e
        if sync not in WeightSync.__members__ or (sync == "adapter" and not lora_rank):
            raise ConfigError(f"vllm.weight_sync={sync}: use one of {', '.join(WeightSync)} ('adapter' needs LoRA).")
        if sync == "weights" and not _reloads_in_place():
            raise ConfigError("vllm.weight_sync=weights needs vLLM's in-place reload_weights(weights_iterator=...), "
                              "which this vLLM lacks: upgrade vLLM, or use vllm.weight_sync=adapter with LoRA.")
        kwargs = {}
        if sync == "adapter":
            kwargs |= {"enable_lora": True, "max_lora_rank": _vllm_rank(lora_rank), "max_loras": 1}
        set_num_threads = torch.set_num_threads
        self.llm = LLM(model=model_path, dtype=dtype, max_model_len=max_model_len, seed=seed,
                       enable_prefix_caching=True, gpu_memory_utilization=gpu_memory_utilization,
                       logprobs_mode="processed_logprobs", enforce_eager=True, **kwargs)
        if os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind":
            # vLLM's CPU worker swaps torch.set_num_threads for a no-op that warns ("after the thread binding"); it
            # bound no threads, and the trainer's code keeps its own thread count
            torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        self.sync_mode = sync
        if sync == "weights":  # vLLM warns at every push that the rotary embedding got no weights: it has none
            logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_no_rotary_warning)
        self._merged = MergedCopy()  # sync=weights: the policy with LoRA merged in, in the policy's dtype
        self._adapters = Path(tempfile.mkdtemp(prefix="grpo_vllm_lora_")) if sync == "adapter" else None
        self._lora = None
        self.version = 0  # policies handed to vLLM so far

    def sync(self, policy) -> None:
        """Hand the policy to vLLM: its weights loaded in place, or its adapter as a new LoRARequest."""
        self.version += 1
        if self.sync_mode == "weights":
            self._load_weights(policy)
            return
        from vllm.lora.request import LoRARequest

        path = self._adapters / f"v{self.version}"
        policy.save_pretrained(str(path))
        previous, self._lora = self._lora, LoRARequest(f"policy-v{self.version}", self.version, str(path))
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def _load_weights(self, policy) -> None:
        # every weight, as a checkpoint names them: a fused vLLM layer (qkv_proj, gate_up_proj) is rebuilt only once
        # all its parts arrived, and a tied LM head, which vLLM packs apart from the embedding, only when its own name
        # (lm_head.weight, which the state dict lists beside embed_tokens.weight) arrives
        plain = self._merged.of(policy)
        weights = ((name, tensor.detach()) for name, tensor in plain.state_dict().items())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        if not self.llm.reset_prefix_cache():  # cached keys and values came from the old weights
            raise RuntimeError("vLLM kept its prefix cache after a weight push (requests still running): its cached "
                               "keys and values would come from the old weights.")

    def generate(self, sequences: list[list[int]], max_new_tokens: int, sampling: dict, eos_ids: list[int],
                 with_logprobs: bool = True) -> tuple[list[list[int]], list[list[float]]]:
        """Per sequence, the sampled ids up to and including its first eos, and their log-probs."""
        from vllm import SamplingParams, TokensPrompt

        sample = bool(sampling.get("do_sample", False))
        params = SamplingParams(
            # ignore_eos: stop at the runtime's eos ids only (the tokenizer's, as the HF decode loop does), not also
            # at the ids of the model's generation_config, which vLLM would add by itself
            n=1, max_tokens=max_new_tokens, stop_token_ids=list(eos_ids), ignore_eos=True, detokenize=False,
            skip_special_tokens=False,
            temperature=float(sampling.get("temperature") or 1.0) if sample else 0.0,
            top_k=int(sampling.get("top_k") or 0) if sample else 0,
            top_p=float(sampling.get("top_p") or 1.0) if sample else 1.0,
            logprobs=0 if with_logprobs else None)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(s)) for s in sequences], params,
                                    use_tqdm=False, lora_request=self._lora)
        ids, logps = [], []
        for out in outputs:
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            ids.append(tokens)
            logps.append([step[token].logprob for step, token in zip(completion.logprobs, tokens, strict=True)]
                         if with_logprobs else [0.0] * len(tokens))
        return ids, logps

    def close(self) -> None:
        """Stop the engine and remove the adapters handed to it."""
        if self._adapters is not None:
            shutil.rmtree(self._adapters, ignore_errors=True)
        shutdown = getattr(getattr(self.llm.llm_engine, "engine_core", None), "shutdown", None)
        if callable(shutdown):
            shutdown()


def _no_rotary_warning(record: logging.LogRecord) -> bool:
    """False for vLLM's "RotaryEmbedding: Failed to load weights" (a cos/sin cache computed from the config, which no
    checkpoint holds); every other record passes."""
    return not (str(record.msg).startswith("%s: Failed to load weights") and record.args
                and "Rotary" in str(record.args[0]))


def _reloads_in_place() -> bool:
    """This vLLM loads weights into a running engine: its model runner's reload_weights takes a weights iterator."""
    import inspect

    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # the CPU runner subclasses it
    except ImportError:
        return False
    reload = getattr(GPUModelRunner, "reload_weights", None)
    return reload is not None and "weights_iterator" in inspect.signature(reload).parameters


def _vllm_rank(rank: int) -> int:
    """vLLM accepts max_lora_rank from a fixed set; the smallest one that fits."""
    for allowed in (8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= allowed:
            return allowed
    raise ConfigError(f"lora.r={rank}: vLLM serves LoRA ranks up to 512.")
