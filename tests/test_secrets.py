"""No secret reaches MLflow, the run dir, the sweep dir or the console, whatever its form: a credential in a URL,
a plain `+env.api_key=...`, and `${oc.env:API_KEY}`; single run, 2-job multirun and a failing constructor. Every
param, tag, run name, note and artifact is read back from the store and every file is scanned; the env still gets
the real values."""

import subprocess
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

from grpo_pipeline.tracking.redact import mask_secrets

SECRET = "s3cr@t"  # a password that itself contains "@"
KEY = "sk-live-7Hq2"  # given plainly
ENV_KEY = "sk-env-Zp81"  # given through ${oc.env:API_KEY}
SECRET_ENV = """
import logging
from datasets import Dataset
class SecretEnv:
    def __init__(self, api_url: str = "", api_key: str = "", auth_token: str = "", fail: bool = False):
        self.api_url, self.api_key, self.auth_token = api_url, api_key, auth_token
        logging.getLogger("secret_env").warning("connecting with %s", api_key)  # a careless env logs its key
        if fail:
            raise RuntimeError(f"login refused for key {api_key}")
    def build_dataset(self, tokenizer):
        return Dataset.from_list([{"prompt": f"Say {i}", "i": i} for i in range(12)])
    def score_episode(self, model, tokenizer, completion, i):
        # the env really received the unmasked values
        got = ("user" in self.api_url) + (self.api_key.startswith("sk-")) + (self.auth_token.startswith("sk-"))
        return got / 4
"""
TINY = ["model=tiny", "env=custom", "env._target_=secret_env.SecretEnv", "training.max_steps=1",
        "training.batch_size=4", "generation.num_generations=2", "generation.max_new_tokens=4",
        "eval.enabled=false"]


def test_mask_secrets_masks_the_whole_userinfo():
    assert mask_secrets("https://user:p@ss@host/x") == "https://***@host/x"
    assert mask_secrets("a=https://u:p@h1,b=http://x:y@h2") == "a=https://***@h1,b=http://***@h2"
    assert mask_secrets("http://host/path?mail=a@b") == "http://host/path?mail=a@b"


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


def _run(tmp_path: Path, *args: str, rc: int = 0) -> subprocess.CompletedProcess:
    import os

    (tmp_path / "secret_env.py").write_text(SECRET_ENV)
    flags = [a for a in args if a == "-m"]
    proc = subprocess.run([sys.executable, "-m", "grpo_pipeline", *flags, *TINY, *(a for a in args if a != "-m")],
                          cwd=tmp_path, env={**os.environ, "API_KEY": ENV_KEY},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == rc, proc.stderr[-3000:]
    return proc


SECRETS = (f"+env.api_key={KEY}", "+env.auth_token=${oc.env:API_KEY}")


def _assert_nowhere(*places: tuple[str, str]) -> None:
    for where, text in places:
        for secret in ("s3cr", KEY, ENV_KEY):
            assert secret not in text, (where, secret)


def test_single_run_leaks_no_url_credential(tmp_path):
    proc = _run(tmp_path, f"+env.api_url=https://user:{SECRET}@api.example.com/v1", *SECRETS, "hydra.run.dir=run")
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("grpo_pipeline").experiment_id])[0]
    assert run.data.metrics["reward"] == 0.75  # the env got the real URL, key and token
    assert run.data.params["env.api_url"] == "https://***@api.example.com/v1"
    assert run.data.params["env.api_key"] == run.data.params["env.auth_token"] == "***"
    _assert_nowhere(("MLflow", _everything_in_mlflow(tmp_path / "outputs" / "mlflow.db")),
                    ("run dir", _every_file_under(tmp_path / "run")),
                    ("console", proc.stdout + proc.stderr))
    assert "https://***@api.example.com" in (tmp_path / "run" / ".hydra" / "overrides.yaml").read_text()
    import yaml

    for name in ("config.yaml", "overrides.yaml", "hydra.yaml"):  # masked, and still YAML
        yaml.safe_load((tmp_path / "run" / ".hydra" / name).read_text())
    assert "connecting with ***" in proc.stdout + proc.stderr  # the env's own log line, masked


def test_multirun_leaks_no_url_credential(tmp_path):
    proc = _run(tmp_path, "-m", f"+env.api_url=https://user:{SECRET}@a.example.com,https://user:{SECRET}@b.example.com",
                *SECRETS, "hydra.sweep.dir=sweep")
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("grpo_pipeline").experiment_id])
    assert len(runs) == 3  # the parent and two jobs
    assert sorted(r.data.metrics.get("reward") for r in runs if "reward" in r.data.metrics) == [0.75, 0.75]
    _assert_nowhere(("MLflow", _everything_in_mlflow(tmp_path / "outputs" / "mlflow.db")),
                    ("sweep dir", _every_file_under(tmp_path / "sweep")),
                    ("console", proc.stdout + proc.stderr))


def test_a_failing_constructor_names_the_kwarg_not_its_value(tmp_path):
    proc = _run(tmp_path, *SECRETS, "+env.fail=true", "hydra.run.dir=run", rc=2)
    assert "api_key=***" in proc.stderr and "login refused for key ***" in proc.stderr
    _assert_nowhere(("console", proc.stdout + proc.stderr), ("run dir", _every_file_under(tmp_path / "run")))


def test_secret_keys_and_values(monkeypatch):
    from omegaconf import OmegaConf

    from grpo_pipeline.tracking import redact

    monkeypatch.setattr(redact, "_PATTERNS", [])

    assert redact.is_secret_key("env.api_key") and redact.is_secret_key("+env.auth.Token")
    assert redact.is_secret_key("env.db_password") and redact.is_secret_key("env.credentials.user")
    assert not redact.looks_secret("32") and not redact.looks_secret(True) and not redact.looks_secret("null")
    cfg = OmegaConf.create({"generation": {"max_new_tokens": 32}, "env": {"api_key": "sk-unit-1", "n": 3,
                                                                          "endpoint": "https://x.example"}})
    assert redact.masked_config(cfg) == {"generation": {"max_new_tokens": 32},
                                         "env": {"api_key": "***", "n": 3, "endpoint": "https://x.example"}}
    assert redact.mask_secrets("key sk-unit-1 failed") == "key *** failed"
    assert redact.mask_override("+env.api_key=sk-unit-1") == "+env.api_key=***"
    assert redact.mask_override("+env.api_key=${oc.env:K}") == "+env.api_key=${oc.env:K}"  # names no secret
    redact.add_secret_patterns(["env.endpoint"])  # tracking.secret_keys
    assert redact.masked_config(cfg)["env"]["endpoint"] == "***"
