"""Sweeps: a 2x2 Hydra multirun on the tiny model -> four MLflow child runs under a parent, a table and
a plot; sweep/launcher/Optuna presets compose; multi-process training through accelerate (gloo, CPU)."""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from mlflow.tracking import MlflowClient

from grpo_pipeline.config import CONFIG_DIR
from grpo_pipeline.tools.compare import main as compare_main
from grpo_pipeline.tracking.sweep import swept_keys

TINY = ["model=tiny", "env.num_samples=16", "training.max_steps=2", "eval.enabled=false",
        "generation.max_new_tokens=4", "training.batch_size=4"]


def test_2x2_sweep_makes_four_child_runs_a_table_and_a_plot(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "grpo_pipeline", "-m", *TINY, "loss.kl_coef=0,0.1",
                           "generation.num_generations=2,4", "hydra.sweep.dir=sweep"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Sweep results (sorted by reward)" in proc.stdout

    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("grpo_pipeline")
    parent_id = (tmp_path / "sweep" / "sweep_parent_run_id").read_text()
    children = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")
    assert len(children) == 4 and all(r.info.status == "FINISHED" for r in children)
    points = {(r.data.params["loss.kl_coef"], r.data.params["generation.num_generations"]) for r in children}
    assert points == {("0.0", "2"), ("0.0", "4"), ("0.1", "2"), ("0.1", "4")}
    assert {r.info.run_name for r in children} == {
        f"loss.kl_coef={k},generation.num_generations={g}" for k in ("0", "0.1") for g in ("2", "4")}
    assert all(r.data.tags["sweep_id"] == "sweep" for r in children)
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["sweep_role"] == "parent"
    assert {a.path for a in client.list_artifacts(parent_id)} >= {"comparison.png", "comparison.txt"}
    assert (tmp_path / "sweep" / "comparison.png").stat().st_size > 1000
    table = (tmp_path / "sweep" / "comparison.txt").read_text()
    assert table.count("FINISHED") == 4 and "loss.kl_coef=0.1,generation.num_generations=4" in table


def test_failed_job_is_marked_and_the_sweep_goes_on(tmp_path):
    (tmp_path / "flaky.py").write_text(
        "from datasets import Dataset\n"
        "class Flaky:\n"
        "    def __init__(self, fail=False):\n        self.fail = fail\n"
        "    def build_dataset(self, tokenizer):\n        return Dataset.from_list([{'prompt': 'x'}] * 8)\n"
        "    def score_episode(self, model, tokenizer, completion):\n"
        "        if self.fail:\n            raise RuntimeError('boom')\n        return 0.5\n")
    tiny = [o for o in TINY if not o.startswith("env")]
    proc = subprocess.run([sys.executable, "-m", "grpo_pipeline", "-m", *tiny, "env=custom", "env._target_=flaky.Flaky",
                           "+env.fail=true,false", "runtime.on_error=raise", "generation.num_generations=2",
                           "hydra.sweep.dir=sweep"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and "1 job(s) of the sweep failed" in proc.stderr + proc.stdout
    table = (tmp_path / "sweep" / "comparison.txt").read_text()
    assert re.search(r"\+env.fail=False\s*\| FINISHED", table) and re.search(r"\+env.fail=True\s*\| FAILED", table)
    failed_row = next(line for line in table.splitlines() if "+env.fail=True" in line)
    assert "boom" in failed_row.rsplit("|", 1)[1]  # the error column: the first line of the run's `error` tag


def test_compare_cli_on_an_experiment(tmp_path, capsys):
    client = MlflowClient(f"sqlite:///{tmp_path / 'm.db'}")
    exp = client.create_experiment("exp", artifact_location=(tmp_path / "a").as_uri())
    for name, rewards in (("low", [0.1, 0.2]), ("high", [0.3, 0.9])):
        run = client.create_run(exp, run_name=name)
        for step, value in enumerate(rewards, 1):
            client.log_metric(run.info.run_id, "reward", value, step=step)
        client.set_terminated(run.info.run_id)
    compare_main(["exp", "--tracking-uri", f"sqlite:///{tmp_path / 'm.db'}", "--out", str(tmp_path / "cmp")])
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith("high ") and lines[3].startswith("low ")  # sorted by final reward
    assert (tmp_path / "cmp" / "comparison.png").exists()


def test_swept_keys():
    assert swept_keys(["model=tiny", "loss.kl_coef=0,0.1", "+env.x=range(1,3)"], {"lora.r": "choice(8,16)"}) == [
        "loss.kl_coef", "env.x", "lora.r"]


def _hydra_compose(overrides):
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            return compose("train", overrides=overrides, return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()


def test_sweep_preset_composes():
    cfg = _hydra_compose(["+sweep=kl_x_generations"])
    assert str(cfg.hydra.mode) == "RunMode.MULTIRUN"
    assert dict(cfg.hydra.sweeper.params) == {"loss.kl_coef": "0.0,0.05,0.1", "generation.num_generations": "4,8"}


@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None,
                    reason="hydra-submitit-launcher not installed (pip install '.[sweep]')")
def test_slurm_launcher_composes():
    cfg = _hydra_compose(["+launcher=slurm"])
    assert "SlurmLauncher" in cfg.hydra.launcher._target_ and cfg.hydra.launcher.gpus_per_node == 1


@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_ray_launcher") is None,
                    reason="hydra-ray-launcher not installed (pip install '.[ray]': pulls Ray, ~GBs)")
def test_ray_launcher_composes():
    cfg = _hydra_compose(["+launcher=ray"])
    assert "RayLauncher" in cfg.hydra.launcher._target_


@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is None,
                    reason="hydra-optuna-sweeper not installed (pip install '.[sweep]')")
def test_optuna_search_composes():
    cfg = _hydra_compose(["+hparams_search=optuna"])
    assert "OptunaSweeper" in cfg.hydra.sweeper._target_ and cfg.hydra.sweeper.direction == "maximize"


def test_two_processes_through_accelerate(tmp_path):
    proc = subprocess.run(["accelerate", "launch", "--num_processes", "2", "--cpu", "--num_machines", "1",
                           "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "grpo_pipeline", *TINY,
                           "generation.num_generations=2", "hydra.run.dir=run"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PATH": f"{sys.prefix}/bin:" + os.environ["PATH"]})
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("grpo_pipeline").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"  # only the main process tracks


def test_the_deepspeed_accelerate_config_is_valid_yaml_and_zero2():
    import yaml

    path = CONFIG_DIR.parent / "accelerate" / "deepspeed_zero2.yaml"  # ZeRO-3 is refused (config/validate.py)
    config = yaml.safe_load(path.read_text())
    assert config["distributed_type"] == "DEEPSPEED" and config["deepspeed_config"]["zero_stage"] == 2


def test_ray_launcher_preset_shape_without_the_plugin():
    from omegaconf import OmegaConf

    preset = OmegaConf.load(CONFIG_DIR / "launcher" / "ray.yaml")
    assert {"override /hydra/launcher": "ray"} in list(preset.defaults)
    assert preset.hydra.launcher.ray.remote.num_gpus == 1


def _sweep_runs(project: Path):
    """(client, parent run, child runs) of the one sweep in project/sweep."""
    client = MlflowClient(f"sqlite:///{project / 'outputs' / 'mlflow.db'}")
    parent_id = (project / "sweep" / "sweep_parent_run_id").read_text()
    experiment = client.get_experiment_by_name("grpo_pipeline")
    return client, client.get_run(parent_id), client.search_runs([experiment.experiment_id],
                                                                  f"tags.mlflow.parentRunId = '{parent_id}'")


def test_jobs_failing_before_their_run_exists_are_failed_child_runs_and_secrets_are_masked(tmp_path):
    tiny = [o for o in TINY if not o.startswith("training.batch_size")]
    proc = subprocess.run([sys.executable, "-m", "grpo_pipeline", "-m", *tiny, "training.batch_size=6,10",
                           "+env.api='https://user:s3cret@example.com/v1'", "hydra.sweep.dir=sweep"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and "2 job(s) of the sweep failed" in proc.stderr, proc.stderr[-3000:]
    assert "s3cret" not in proc.stdout + proc.stderr
    client, parent, children = _sweep_runs(tmp_path)
    assert parent.info.status == "FINISHED"
    assert "s3cret" not in parent.info.run_name + json.dumps(parent.data.tags)
    assert "+env.api='https://***@example.com/v1'" in parent.info.run_name
    assert sorted(r.info.run_name for r in children) == ["training.batch_size=10", "training.batch_size=6"]
    for run in children:
        size = run.info.run_name.split("=")[1]
        assert run.info.status == "FAILED" and run.data.tags["sweep_id"] == "sweep"
        assert f"training.batch_size={size}" in run.data.tags["overrides"]
        assert "https://***@example.com/v1" in run.data.tags["overrides"] and "s3cret" not in json.dumps(run.data.tags)
        assert run.data.tags["error"].startswith(f"Invalid config: training.batch_size={size} x gradient_accumulation")
        assert run.data.params["training.batch_size"] == size and "s3cret" not in json.dumps(run.data.params)
    table = (tmp_path / "sweep" / "comparison.txt").read_text()
    assert "s3cret" not in table and "error" in table.splitlines()[0]
    for size in ("6", "10"):
        assert re.search(rf"training.batch_size={size}\s*\| FAILED .*\| Invalid config: training.batch_size={size} x ",
                         table), table
    assert not any((tmp_path / "sweep" / str(n) / "mlflow_run_id").exists() for n in (0, 1))


SLOW_ENV = """
import time
from pathlib import Path
from datasets import Dataset
class SlowEnv:
    thread_safe = False
    def __init__(self, delay=0.1, block_in_build=False):
        self.delay, self.block_in_build = delay, block_in_build
    def build_dataset(self, tokenizer):
        if self.block_in_build:
            Path("building").write_text("")
            time.sleep(300)
        return Dataset.from_list([{"prompt": f"Count to {i}"} for i in range(64)])
    def score_episode(self, model, tokenizer, completion):
        time.sleep(self.delay)
        return 0.5
"""


def _start_sweep(project: Path, *overrides: str) -> subprocess.Popen:
    (project / "slow_env.py").write_text(SLOW_ENV)
    tiny = [o for o in TINY if not o.startswith("env")]
    out = (project / "stdout.txt").open("w")
    return subprocess.Popen([sys.executable, "-m", "grpo_pipeline", "-m", *tiny, "env=custom",
                             "env._target_=slow_env.SlowEnv", "generation.num_generations=2", "training.max_steps=200",
                             "hydra.sweep.dir=sweep", *overrides], cwd=project, stdout=out, stderr=subprocess.PIPE,
                            text=True)


def _wait_until(condition, proc: subprocess.Popen, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the sweep ended before {what}: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout}s"
        time.sleep(0.2)


def test_sigterm_during_training_stops_the_whole_sweep(tmp_path):
    proc = _start_sweep(tmp_path, "+env.delay=0.1,0.05,0.01")
    _wait_until(lambda: "step 1/200" in (tmp_path / "stdout.txt").read_text(), proc, "job 0's first step")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Stopped by signal 15" in err and "no further job starts" in err
    _, parent, children = _sweep_runs(tmp_path)
    assert parent.info.status == "KILLED"
    assert [(r.info.run_name, r.info.status) for r in children] == [("+env.delay=0.1", "KILLED")]
    assert (tmp_path / "sweep" / "0" / "checkpoints").is_dir()  # the stopped job saved where it was
    table = (tmp_path / "sweep" / "comparison.txt").read_text()  # compared at exit, logged to the parent
    assert re.search(r"\+env.delay=0.1\s*\| KILLED", table) and len(table.splitlines()) == 3
    assert not (tmp_path / "sweep" / "1").exists() and not (tmp_path / "sweep" / "2").exists()


@pytest.mark.slow  # ~15-20 s of subprocess launches; its behaviour's core is covered in the default suite
def test_sigint_before_training_stops_the_whole_sweep(tmp_path):
    proc = _start_sweep(tmp_path, "+env.block_in_build=true", "+env.delay=0.1,0.05,0.01")
    _wait_until(lambda: (tmp_path / "building").exists(), proc, "job 0 building its dataset")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert "Stopped by signal 2 (SIGINT)." in err and "no further job starts" in err and "Traceback" not in err
    assert len((tmp_path / "sweep" / "comparison.txt").read_text().splitlines()) == 2  # header only
    _, parent, children = _sweep_runs(tmp_path)
    assert parent.info.status == "KILLED" and children == []  # job 0 had no run yet; job 1 and 2 never started
    assert not (tmp_path / "sweep" / "1").exists() and not (tmp_path / "sweep" / "2").exists()


needs_optuna = pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is None,
                                  reason="hydra-optuna-sweeper not installed (pip install '.[sweep]')")
FLAKY_ENV = (
    "from datasets import Dataset\n"
    "class Flaky:\n"
    "    def __init__(self, fail=False):\n        self.fail = fail\n"
    "    def build_dataset(self, tokenizer):\n        return Dataset.from_list([{'prompt': 'x'}] * 8)\n"
    "    def score_episode(self, model, tokenizer, completion):\n"
    "        if self.fail:\n            raise RuntimeError('boom')\n        return 0.5\n")


@needs_optuna
def test_optuna_study_goes_on_after_a_failed_trial(tmp_path):
    (tmp_path / "flaky.py").write_text(FLAKY_ENV)
    tiny = [o for o in TINY if not o.startswith("env")]
    # TPE with seed 0 starts with random trials: fail=False, True, False.
    proc = subprocess.run([sys.executable, "-m", "grpo_pipeline", "-m", "hydra/sweeper=optuna", *tiny, "env=custom",
                           "env._target_=flaky.Flaky", "+env.fail=choice(true,false)", "runtime.on_error=raise",
                           "generation.num_generations=2", "hydra.sweeper.n_trials=3", "hydra.sweeper.sampler.seed=0",
                           "hydra.sweeper.direction=maximize", "hydra.sweep.dir=sweep"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and "1 job(s) of the sweep failed" in proc.stderr, proc.stderr[-3000:]
    assert (tmp_path / "sweep" / "optimization_results.yaml").exists()  # the study ran to its end
    _, parent, children = _sweep_runs(tmp_path)
    assert parent.info.status == "FINISHED"
    assert sorted((r.info.run_name, r.info.status) for r in children) == [
        ("+env.fail=False", "FINISHED"), ("+env.fail=False", "FINISHED"), ("+env.fail=True", "FAILED")]
    assert "boom" in next(r for r in children if r.info.status == "FAILED").data.tags["error"]
    table = (tmp_path / "sweep" / "comparison.txt").read_text()
    assert re.search(r"\+env.fail=True\s*\| FAILED .*boom", table), table


@pytest.mark.slow  # test_optuna_study_goes_on_after_a_failed_trial covers a failing trial by default
@needs_optuna
def test_optuna_study_where_every_trial_fails_closes_the_parent(tmp_path):
    tiny = [o for o in TINY if not o.startswith("training.batch_size")]
    proc = subprocess.run([sys.executable, "-m", "grpo_pipeline", "-m", "hydra/sweeper=optuna", *tiny,
                           "training.batch_size=choice(6,10)", "hydra.sweeper.n_trials=2", "hydra.sweeper.sampler.seed=0",
                           "hydra.sweep.dir=sweep"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    _, parent, children = _sweep_runs(tmp_path)
    assert parent.info.status == "FAILED"  # the sweeper raised (no completed trial), not left RUNNING
    assert len(children) == 2 and all(r.info.status == "FAILED" for r in children)
    assert (tmp_path / "sweep" / "comparison.txt").read_text().count("| FAILED ") == 2


def test_error_line():
    from grpo_pipeline.tracking.sweep import error_line

    try:
        raise RuntimeError("boom")
    except RuntimeError as e:
        import traceback

        embedded = "".join(traceback.format_exception(e)).rstrip()
    assert error_line(RuntimeError(f"Env.score_episode raised:\n{embedded}\nrow: {{}}")) == \
        "Env.score_episode raised: RuntimeError: boom"
    assert error_line(ValueError("Invalid config:\n  - training.batch_size=6 x 1\n  - b")) == \
        "Invalid config: training.batch_size=6 x 1"
    assert error_line(KeyError()) == "KeyError"
    assert error_line(OSError("https://user:pw@host/x unreachable\nmore")) == "https://***@host/x unreachable"


def test_bootstrap_interval_on_known_data():
    from grpo_pipeline.tools.compare import bootstrap_mean, welch_difference

    assert bootstrap_mean([0.3, 0.3, 0.3]) == (0.3, 0.3, 0.3)  # no spread, no interval
    mean, low, high = bootstrap_mean([1.0, 2.0, 3.0])
    assert mean == 2.0 and 1.0 <= low < 2.0 < high <= 3.0
    # on a large normal sample the percentile interval is the textbook mean +- 1.96 sd / sqrt(n)
    sample = np.random.default_rng(1).normal(0.5, 0.2, size=400)
    mean, low, high = bootstrap_mean(sample)
    half = 1.96 * sample.std(ddof=1) / np.sqrt(sample.size)
    assert abs(low - (mean - half)) < 0.004 and abs(high - (mean + half)) < 0.004
    # Welch: diff 0.4, se sqrt(2 * 1e-4 / 3), df 4, t(0.975, 4) = 2.7764 (as R's t.test gives)
    low, high = welch_difference([0.50, 0.51, 0.52], [0.10, 0.11, 0.12])
    assert low == pytest.approx(0.4 - 2.7764 * (2e-4 / 3) ** 0.5, abs=1e-4)
    assert high == pytest.approx(0.4 + 2.7764 * (2e-4 / 3) ** 0.5, abs=1e-4)


def _run(client, exp, name, after, overrides):
    run = client.create_run(exp, run_name=name, tags={"overrides": overrides})
    client.log_metric(run.info.run_id, "reward", 0.5, step=1)
    client.log_metric(run.info.run_id, "eval_after/mean_reward", after)
    client.set_terminated(run.info.run_id)


def test_compare_groups_seeds_into_points_with_intervals(tmp_path, capsys):
    client = MlflowClient(f"sqlite:///{tmp_path / 'm.db'}")
    exp = client.create_experiment("exp", artifact_location=(tmp_path / "a").as_uri())
    scores = {"loss.kl_coef=0.0": [0.80, 0.82, 0.81],    # clearly best
              "loss.kl_coef=0.05": [0.70, 0.90, 0.78],   # noisy: overlaps the best
              "loss.kl_coef=0.1": [0.20, 0.22, 0.21]}    # clearly worse
    for point, values in scores.items():
        for seed, value in enumerate(values):
            _run(client, exp, f"{point},seed={seed}", value, f"model=tiny {point} seed={seed}")
    _run(client, exp, "loss.kl_coef=0.2,seed=0", 0.99, "model=tiny loss.kl_coef=0.2 seed=0")  # one lucky seed
    compare_main(["exp", "--tracking-uri", f"sqlite:///{tmp_path / 'm.db'}", "--out", str(tmp_path / "cmp")])
    out = capsys.readouterr().out
    section = out.split("Per point over seeds")[1].splitlines()
    rows = {line.split("|")[0].strip(): [c.strip() for c in line.split("|")] for line in section if "|" in line}
    best = rows["loss.kl_coef=0.0"]
    assert best[1:3] == ["3", "0.810"] and best[4] == "best"
    assert rows["loss.kl_coef=0.05"][4].startswith("within seed noise")
    assert rows["loss.kl_coef=0.1"][4].startswith("worse")
    assert rows["loss.kl_coef=0.2"][1:3] == ["1", "0.990"] and rows["loss.kl_coef=0.2"][4] == "n/a (1 seed)"
    low, high = (float(x) for x in rows["loss.kl_coef=0.1"][3].split(".."))
    assert 0.20 <= low <= 0.21 <= high <= 0.22
    assert (tmp_path / "cmp" / "comparison_points.png").stat().st_size > 1000


def test_seeded_sweep_preset_composes():
    cfg = _hydra_compose(["+sweep=kl_x_generations_seeded"])
    assert dict(cfg.hydra.sweeper.params) == {"loss.kl_coef": "0.0,0.05,0.1", "generation.num_generations": "4,8",
                                              "seed": "0,1,2"}


@pytest.mark.slow  # ~15-20 s of subprocess launches; its behaviour's core is covered in the default suite
def test_a_3_seed_x_2_point_tiny_sweep_prints_intervals_per_point(tmp_path):
    """Issue 15's acceptance run, for real: six tiny trainings in one multirun, seeds grouped into points."""
    (tmp_path / "graded.py").write_text(  # two steps barely move a random tiny model: a score the seed decides
        "import random\n"
        "from datasets import Dataset\n"
        "class Graded:\n"
        "    def build_dataset(self, tokenizer):\n"
        "        return Dataset.from_list([{'prompt': f'count to {i}'} for i in range(40)])\n"
        "    def score_episode(self, model, tokenizer, completion):\n"
        "        return random.random()\n")
    tiny = [o for o in TINY if not o.startswith(("eval.", "env."))]
    proc = subprocess.run([sys.executable, "-m", "grpo_pipeline", "-m", *tiny, "env=custom", "env._target_=graded.Graded",
                           "loss.kl_coef=0,0.1", "seed=0,1,2", "generation.num_generations=2", "eval.num_prompts=8",
                           "eval.every_steps=0", "hydra.sweep.dir=sweep"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (tmp_path / "sweep" / "comparison.txt").read_text()
    assert table.count("FINISHED") == 6
    section = table.split("Per point over seeds")[1].splitlines()
    rows = [[c.strip() for c in line.split("|")] for line in section if "|" in line and "seed" not in line.split("|")[0]]
    rows = [r for r in rows if r[0].startswith("loss.kl_coef=")]
    assert sorted(r[0] for r in rows) == ["loss.kl_coef=0", "loss.kl_coef=0.1"], table
    for cells in rows:
        assert cells[1] == "3"  # three seeds form the point
        low, high = (float(x) for x in cells[3].split(".."))
        assert low <= float(cells[2]) <= high
    assert any(float(r[3].split("..")[1]) > float(r[3].split("..")[0]) for r in rows), table  # seeds differ
    assert "best" in {r[4] for r in rows}
    assert (tmp_path / "sweep" / "comparison_points.png").stat().st_size > 1000


@pytest.mark.slow  # four tiny trainings in subprocesses
def test_a_seeded_sweep_over_a_trl_environment(tmp_path):
    """Issue 37 item 4: a TRL environment_factory env in a Hydra multirun, seeds grouped into points."""
    tiny = [o for o in TINY if not o.startswith(("eval.", "env."))]
    proc = subprocess.run([sys.executable, "-m", "grpo_pipeline", "-m", *tiny, "env=trl", "env.num_episodes=24",
                           "env.max_turns=2", "env.turn_max_new_tokens=6", "loss.kl_coef=0,0.1", "seed=0,1",
                           "generation.num_generations=2", "eval.num_prompts=4", "eval.every_steps=0",
                           "hydra.sweep.dir=sweep"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (tmp_path / "sweep" / "comparison.txt").read_text()
    assert table.count("FINISHED") == 4, table
    section = table.split("Per point over seeds")[1].splitlines()
    rows = [[c.strip() for c in line.split("|")] for line in section if "|" in line]
    rows = [r for r in rows if r[0].startswith("loss.kl_coef=")]
    assert sorted(r[0] for r in rows) == ["loss.kl_coef=0", "loss.kl_coef=0.1"] and all(r[1] == "2" for r in rows)
    runs = sorted((tmp_path / "sweep").glob("*/episodes.jsonl")) or sorted((tmp_path / "sweep").rglob("episodes.jsonl"))
    assert len(runs) == 4 and all("I am thinking of" in p.read_text() for p in runs)
