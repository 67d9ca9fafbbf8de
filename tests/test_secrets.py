"""A credential written into a URL override never reaches MLflow, the run dir or the console: single run and
a 2-job multirun, every param, tag, run name and artifact read back from the store, every file scanned."""

import subprocess
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

from grpo_pipeline.redact import mask_credentials

SECRET = "s3cr@t"  # a password that itself contains "@"
SECRET_ENV = """
from datasets import Dataset
class SecretEnv:
    def __init__(self, api_url: str = ""):
        self.api_url = api_url
    def build_dataset(self, tokenizer):
        return Dataset.from_list([{"prompt": f"Say {i}", "i": i} for i in range(12)])
    def score_episode(self, model, tokenizer, completion, i):
        return 0.5 if "user" in self.api_url else 0.0  # the env really received the unmasked URL
"""
TINY = ["model=tiny", "env=custom", "env._target_=secret_env.SecretEnv", "training.max_steps=1",
        "training.batch_size=4", "generation.num_generations=2", "generation.max_new_tokens=4",
        "eval.enabled=false"]


def test_mask_credentials_masks_the_whole_userinfo():
    assert mask_credentials("https://user:p@ss@host/x") == "https://***@host/x"
    assert mask_credentials("a=https://u:p@h1,b=http://x:y@h2") == "a=https://***@h1,b=http://***@h2"
    assert mask_credentials("http://host/path?mail=a@b") == "http://host/path?mail=a@b"


def _everything_in_mlflow(db: Path) -> str:
    client = MlflowClient(f"sqlite:///{db}")
    texts = []
    for exp in client.search_experiments():
        texts += [exp.name, str(exp.tags)]
        for run in client.search_runs([exp.experiment_id]):
            texts += [run.info.run_name or "", str(run.data.params), str(run.data.tags), str(run.data.metrics)]
            root = Path(client.download_artifacts(run.info.run_id, "", str(db.parent / f"dl-{run.info.run_id}")))
            texts += [p.read_bytes().decode("utf-8", "replace") for p in root.rglob("*") if p.is_file()]
    assert len(texts) > 5
    return "\n".join(texts)


def _every_file_under(folder: Path) -> str:
    return "\n".join(p.read_bytes().decode("utf-8", "replace") for p in folder.rglob("*") if p.is_file())


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "secret_env.py").write_text(SECRET_ENV)
    flags = [a for a in args if a == "-m"]
    proc = subprocess.run([sys.executable, "-m", "grpo_pipeline", *flags, *TINY, *(a for a in args if a != "-m")],
                          cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_single_run_leaks_no_url_credential(tmp_path):
    proc = _run(tmp_path, f"+env.api_url=https://user:{SECRET}@api.example.com/v1", "hydra.run.dir=run")
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("grpo_pipeline").experiment_id])[0]
    assert run.data.metrics["reward"] == 0.5  # the env got the real URL
    assert run.data.params["env.api_url"] == "https://***@api.example.com/v1"
    for where, text in (("MLflow", _everything_in_mlflow(tmp_path / "outputs" / "mlflow.db")),
                        ("run dir", _every_file_under(tmp_path / "run")),
                        ("console", proc.stdout + proc.stderr)):
        assert "s3cr" not in text, where
    assert "https://***@api.example.com" in (tmp_path / "run" / ".hydra" / "overrides.yaml").read_text()


def test_multirun_leaks_no_url_credential(tmp_path):
    proc = _run(tmp_path, "-m", f"+env.api_url=https://user:{SECRET}@a.example.com,https://user:{SECRET}@b.example.com",
                "hydra.sweep.dir=sweep")
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("grpo_pipeline").experiment_id])
    assert len(runs) == 3  # the parent and two jobs
    for where, text in (("MLflow", _everything_in_mlflow(tmp_path / "outputs" / "mlflow.db")),
                        ("sweep dir", _every_file_under(tmp_path / "sweep")),
                        ("console", proc.stdout + proc.stderr)):
        assert "s3cr" not in text, where
