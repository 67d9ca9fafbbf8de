"""Launch vLLM server mode: TRL's vLLM server on dedicated GPUs, training on the rest.

    python -m grpo_pipeline launch --num-gpus 8 --dry-run -- model=deepseek_r1_distill_qwen_1_5b vllm=server vllm.server_gpus=2
    python -m grpo_pipeline launch -- vllm=server vllm.server_gpus=2      # run: start server, wait, train, stop

With 8 GPUs and vllm.server_gpus=2: `trl vllm-serve` runs on GPUs 0,1 (tensor_parallel_size x
data-parallel = 2) and `accelerate launch --num_processes 6 -m grpo_pipeline ...` trains on GPUs 2-7.
"""

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

from grpo_pipeline.errors import ConfigError


@dataclass
class LaunchPlan:
    server_gpus: list[int]
    train_gpus: list[int]
    server_cmd: list[str]
    train_cmd: list[str]
    health_url: str

    def shell(self) -> str:
        s, t = ",".join(map(str, self.server_gpus)), ",".join(map(str, self.train_gpus))
        return (f"CUDA_VISIBLE_DEVICES={s} {shlex.join(self.server_cmd)} &\n"
                f"# wait until {self.health_url} answers, then:\n"
                f"CUDA_VISIBLE_DEVICES={t} {shlex.join(self.train_cmd)}")


def plan(num_gpus: int, model_path: str, server_gpus: int, tensor_parallel_size: int, host: str, port: int,
         overrides: list[str]) -> LaunchPlan:
    if server_gpus < 1:
        raise ConfigError(f"vllm.server_gpus={server_gpus}: server mode needs at least one GPU for vLLM.")
    if server_gpus >= num_gpus:
        raise ConfigError(
            f"vllm.server_gpus={server_gpus} leaves none of the {num_gpus} GPUs for training; lower it "
            "(e.g. 2 of 8), or use vllm=colocate on a single GPU."
        )
    if server_gpus % tensor_parallel_size:
        raise ConfigError(
            f"vllm.tensor_parallel_size={tensor_parallel_size} does not divide vllm.server_gpus={server_gpus}; "
            "the server runs server_gpus / tensor_parallel_size data-parallel replicas."
        )
    train = list(range(server_gpus, num_gpus))
    server_cmd = ["trl", "vllm-serve", "--model", model_path, "--tensor-parallel-size", str(tensor_parallel_size),
                  "--data-parallel-size", str(server_gpus // tensor_parallel_size), "--host", host,
                  "--port", str(port)]
    train_cmd = ["accelerate", "launch", "--num_processes", str(len(train)), "-m", "grpo_pipeline", *overrides]
    return LaunchPlan(list(range(server_gpus)), train, server_cmd, train_cmd, f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}/health")


def _model_path(cfg) -> str:
    if cfg.model.source == "hub":
        return cfg.model.name_or_path
    if cfg.model.source == "gguf":
        from grpo_pipeline.models import convert_gguf

        return str(convert_gguf(cfg.model))
    raise ConfigError("model=tiny is built in code and cannot be served by vLLM; pick a hub or gguf model.")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-gpus", type=int, default=None, help="GPUs on this node (default: all visible)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the training job")
    args = parser.parse_args(argv)
    from hydra import compose, initialize_config_dir

    from grpo_pipeline.config import CONFIG_DIR
    from grpo_pipeline.config.schema import register_configs

    register_configs()
    overrides = [o for o in args.overrides if not o.startswith("vllm=")] + ["vllm=server"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    num_gpus = args.num_gpus
    if num_gpus is None:
        import torch

        num_gpus = torch.cuda.device_count()
    try:
        p = plan(num_gpus, _model_path(cfg), cfg.vllm.server_gpus, cfg.vllm.tensor_parallel_size,
                 cfg.vllm.server_host, cfg.vllm.server_port, overrides)
    except ConfigError as e:
        sys.exit(f"ERROR: {e}")
    from grpo_pipeline.tracking.redact import mask_secrets, register_overrides

    register_overrides(overrides)
    print(mask_secrets(p.shell()))
    if args.dry_run:
        return
    sys.exit(run(p))


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the launcher dies, even by SIGKILL (Linux's PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


def run(p: LaunchPlan, ready_timeout_s: float = 900) -> int:
    """Start the server, wait until it (and not another process on its port) answers, train, stop the server.
    SIGTERM and Ctrl-C are forwarded once to the training launcher, which checkpoints and stops; the launcher
    waits for it, then stops the server. Both children die with this process."""
    _port_is_free(p.health_url)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(map(str, p.server_gpus)))
    server = subprocess.Popen(p.server_cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)
    train = None
    forwarded: list[int] = []

    def forward(signum, frame):
        forwarded.append(signum)
        if train is None:  # still waiting for the server: nothing trained yet
            raise KeyboardInterrupt
        train.send_signal(signum)  # a second Ctrl-C is forwarded too: the training stops at once

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        _wait_for(p.health_url, server, ready_timeout_s)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(map(str, p.train_gpus)))
        # its own session: a terminal's Ctrl-C reaches it once, through forward(), not twice
        train = subprocess.Popen(p.train_cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)
        code = train.wait()
        if forwarded:
            print(f"launch: training stopped after signal {forwarded[0]} (exit code {code}); stopping the server.",
                  file=sys.stderr)
        return code
    except KeyboardInterrupt:
        print("launch: stopped before training started; stopping the server.", file=sys.stderr)
        return 128 + (forwarded[0] if forwarded else signal.SIGINT)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop(server)


def _stop(server: subprocess.Popen, grace_s: float = 30) -> None:
    if server.poll() is not None:
        return
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    except ProcessLookupError:
        pass


def _port_is_free(url: str) -> None:
    """The health check must reach the server this launcher starts, not one already on the port."""
    import socket
    from urllib.parse import urlparse

    where = urlparse(url)
    with socket.socket() as s:
        s.settimeout(2)
        if s.connect_ex((where.hostname, where.port)) == 0:
            sys.exit(f"ERROR: something already listens on {where.hostname}:{where.port} (another vLLM server?); "
                     "its health check would pass for a server this launcher did not start. Stop it, or set "
                     "vllm.server_port to a free port.")


def _wait_for(url: str, server: subprocess.Popen, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"ERROR: the vLLM server exited with code {server.returncode} before it was ready.")
        try:
            with urllib.request.urlopen(url, timeout=5):
                if server.poll() is None:  # answered while ours is alive (the port was free before it started)
                    return
        except OSError:
            time.sleep(1)
    sys.exit(f"ERROR: the vLLM server did not answer {url} within {timeout_s:.0f}s.")


if __name__ == "__main__":
    main()
