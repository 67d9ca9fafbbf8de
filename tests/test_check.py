"""The env doctor: a report with score statistics and warnings; non-zero exit when the env is broken."""



from grpo_pipeline.check import run_check

SHRINK = ["model=tiny", "check.num_prompts=2", "generation.max_new_tokens=6", "generation.num_generations=3",
          "training.batch_size=6"]

BROKEN_ENV = """
from datasets import Dataset
class Broken:
    def build_dataset(self, tokenizer):
        return Dataset.from_list([{"prompt": f"q{i}", "i": i} for i in range(4)])
    def score_episode(self, model, tokenizer, completion, i):
        if i % 2:
            raise KeyError("missing answer")
        return 2.0
"""


def test_report_on_a_working_env(compose_cfg, tmp_path):
    cfg = compose_cfg([*SHRINK, "env.num_samples=10", f"output_dir={tmp_path}"])
    report = run_check(cfg)
    text = report.text()
    assert "dataset: 10 rows, columns ['prompt', 'answer']" in text
    assert "generated 6 completions (2 prompts x 3)" in text
    assert "scores: n=6" in text and "groups: 2" in text and "failures: 0, timeouts: 0" in text
    # the tiny random model never earns credit: the doctor says so, and what to do
    assert any("all scores are 0" in w for w in report.warnings)
    assert not report.broken and "verdict: OK with warnings" in text


def test_broken_env_exits_nonzero_with_reasons(tmp_path):
    (tmp_path / "broken_env.py").write_text(BROKEN_ENV)
    proc = run_cli_check([*SHRINK, "env=custom", "env._target_=broken_env.Broken"], tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "BROKEN: score_episode raised KeyError" in proc.stdout
    assert "BROKEN: score_episode returned 2.0" in proc.stdout and "verdict: BROKEN" in proc.stdout


def test_unloadable_env_exits_2(tmp_path):
    proc = run_cli_check([*SHRINK, "env=custom", "env._target_=nowhere.Env"], tmp_path)
    assert proc.returncode == 2 and "module 'nowhere' cannot be imported" in proc.stderr


def run_cli_check(args, cwd):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "grpo_pipeline.check", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


