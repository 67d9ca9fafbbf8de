"""Where the time of real training steps goes: runs the pipeline (any overrides) and prints, per step, the seconds
of the rollout (its decode loop, the generation copy's refresh, the shared-prefix prefill), of the loss forward,
and of the whole training step. Nothing is changed in the run; the functions are only timed.

    .venv/bin/python scripts/profile_step.py training.max_steps=3 eval.enabled=false
    .venv/bin/python scripts/profile_step.py env=hotel training.max_steps=2 training.batch_size=8 \
        generation.oversample=1 generation.max_new_tokens=64 eval.enabled=false runtime.generation_dtype=float32

    .venv-vllm/bin/python scripts/profile_step.py vllm=colocate training.max_steps=3 eval.enabled=false

Run it alone on the machine: two jobs on 2 cores slow each other several-fold.
"""

import collections
import functools
import sys
import time

from grpo_pipeline.api import train
from grpo_pipeline.rollout import decode as sampler
from grpo_pipeline.rollout import policy_copy as merged
from grpo_pipeline.rollout import turns as rollout
from grpo_pipeline.rollout import vllm_engine as vllm_backend
from grpo_pipeline.training import trainer

SECONDS: dict[str, list[float]] = collections.defaultdict(list)


def timed(owner, name: str, label: str) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            SECONDS[label].append(time.perf_counter() - started)

    setattr(owner, name, wrapper)


def main() -> None:
    timed(trainer.PipelineTrainer, "training_step", "training step")
    timed(rollout.Rollout, "run", "rollout")
    timed(rollout, "decode", "  decode loop")  # rollout.py calls sampler.decode by this name
    timed(merged.MergedCopy, "of", "  copy refresh")
    timed(rollout.SharedPrefix, "build", "  prefix prefill")
    timed(vllm_backend.VllmBackend, "sync", "  vllm sync")  # vllm=colocate: the policy handed to vLLM
    timed(vllm_backend.VllmBackend, "generate", "  vllm turn")
    timed(trainer.PipelineTrainer, "_compute_loss", "loss forward")
    timed(trainer.PipelineTrainer, "_get_per_token_logps_and_entropies", "logps forwards")  # loss, old, reference
    assert rollout.decode is not sampler.decode
    train(sys.argv[1:])
    print("\nseconds per call, in order:")
    for label, values in SECONDS.items():
        print(f"{label:<16} " + " ".join(f"{v:6.2f}" for v in values))


if __name__ == "__main__":
    main()
