"""Keep secrets out of everything we write: MLflow (params, tags, run names, notes, artifacts), the console and
log files, the run and sweep dirs (resolved config, Hydra's .hydra/*.yaml, the ledger, summary.json) and error
messages.

What counts as a secret:
- credentials written into a URL (`scheme://user:password@host`);
- the string value of a config key any part of whose dotted name contains `key`, `token`, `secret`, `password`,
  `passwd` or `credential` (`env.api_key`, `env.auth.token`; numbers and booleans are not secrets, so
  `generation.max_new_tokens=32` stays readable), plus the glob patterns in `tracking.secret_keys`;
- whatever a `${oc.env:VAR}` interpolation resolves to, whatever its key.

Their values are registered once, from the command line before Hydra logs anything (`register_overrides`) and
from the composed config when the job starts (`register_config`); from then on `mask_secrets` replaces every
occurrence of them in any text with `***`, and the config itself is written through `masked_config`. The env
still receives the real values: nothing here changes the config. No heavy imports: the CLI uses this first.
"""

import fnmatch
import logging
import os
import re
from pathlib import Path
from typing import Any

MASK = "***"
SECRET_WORDS = ("key", "token", "secret", "password", "passwd", "credential")
MIN_MASKED_LEN = 4  # shorter secret values are masked where the config is written, not inside free text
# Everything between "://" and the last "@" before the host: a password may itself contain "@".
_URL_CREDENTIALS = re.compile(r"://[^/\s'\"]*@")
_ENV_INTERPOLATION = re.compile(r"\$\{oc\.env:([^,}]+)(?:,([^}]*))?\}")
_NOT_SECRET = re.compile(r"^(?:[-+]?[\d_.]+(?:e[-+]?\d+)?|true|false|null|none|~|)$", re.IGNORECASE)
_SECRETS: tuple[str, ...] = ()  # longest first
_PATTERNS: list[str] = []  # tracking.secret_keys


def mask_secrets(text: str) -> str:
    """URL credentials -> `***@`, every registered secret value -> `***`."""
    text = _URL_CREDENTIALS.sub(f"://{MASK}@", text)
    for secret in _SECRETS:  # longest first: a secret containing another is masked whole
        if secret in text:
            text = text.replace(secret, MASK)
    return text


def is_secret_key(key: str) -> bool:
    """A dotted config key whose string value is a secret."""
    key = key.lstrip("+~").lower()
    return any(word in key for word in SECRET_WORDS) or any(fnmatch.fnmatch(key, p.lower()) for p in _PATTERNS)


def looks_secret(value: Any) -> bool:
    """A value that can be a secret: a string that is not a number, a boolean or null."""
    return isinstance(value, str) and not _NOT_SECRET.match(value.strip())


def register_secret(value: str) -> None:
    global _SECRETS
    if isinstance(value, str) and len(value) >= MIN_MASKED_LEN and value != MASK:
        _SECRETS = tuple(sorted(set(_SECRETS) | {value}, key=len, reverse=True))


def add_secret_patterns(patterns) -> None:
    for pattern in patterns or ():
        if pattern not in _PATTERNS:
            _PATTERNS.append(str(pattern))


def register_overrides(overrides: list[str]) -> None:
    """Command-line overrides (`key=value`, sweep lists too): register the values of secret keys and what their
    `${oc.env:...}` interpolations resolve to. Called before Hydra composes (or logs) anything."""
    for override in overrides:
        key, eq, value = override.partition("=")
        if not eq:
            continue
        if key.lstrip("+~") == "tracking.secret_keys":
            add_secret_patterns(p.strip(" '\"") for p in value.strip("[]").split(",") if p.strip())
        for name, default in _ENV_INTERPOLATION.findall(value):
            register_secret(os.environ.get(name.strip(), default))
        if is_secret_key(key) and looks_secret(value):
            unquoted = value.strip("'\"")
            for part in (unquoted, *unquoted.split(",")):  # a multirun's `key=a,b`: each value
                if looks_secret(part.strip("'\" ")):
                    register_secret(part.strip("'\" "))


def secret_paths(cfg) -> set[str]:
    """The dotted keys of `cfg` (an OmegaConf config) whose values are secret; their values are registered."""
    from omegaconf import OmegaConf

    add_secret_patterns(OmegaConf.select(cfg, "tracking.secret_keys", default=None) or [])
    raw = OmegaConf.to_container(cfg, resolve=False)
    paths = set()
    for path, value in _leaves(raw):
        from_env = isinstance(value, str) and "${oc.env:" in value
        if not (from_env or (is_secret_key(path) and looks_secret(value))):
            continue
        try:
            resolved = OmegaConf.select(cfg, path, throw_on_missing=False)
        except Exception:  # an interpolation that cannot resolve yet: nothing to mask
            continue
        if from_env or looks_secret(resolved):
            paths.add(path)
            if isinstance(resolved, str):
                register_secret(resolved)
    return paths


def register_config(cfg) -> None:
    secret_paths(cfg)


def masked_config(cfg, resolve: bool = True) -> Any:
    """The config as plain containers with every secret value replaced by `***`: what is written or logged."""
    from omegaconf import OmegaConf

    paths = secret_paths(cfg)
    data = OmegaConf.to_container(cfg, resolve=resolve)
    for path in paths:
        *parents, last = path.split(".")
        node = data
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[int(last) if isinstance(node, list) else last] = MASK
    return _mask_strings(data)


def mask_override(override: str) -> str:
    """`+env.api_key=sk-1` -> `+env.api_key=***`; `${oc.env:X}` stays as written (it names no secret)."""
    key, eq, value = override.partition("=")
    if eq and is_secret_key(key) and looks_secret(value) and "${oc.env:" not in value:
        return f"{key}={MASK}"
    return mask_secrets(override)


def _leaves(node: Any, prefix: str = ""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{prefix}{k}.")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _leaves(v, f"{prefix}{i}.")
    else:
        yield prefix.rstrip("."), node


def _mask_strings(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _mask_strings(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_mask_strings(v) for v in node]
    return mask_secrets(node) if isinstance(node, str) else node


def redact_log_records() -> None:
    """Mask secrets in every log record from now on, whichever handler writes it (console, Hydra's job log
    file). A record factory, not a handler filter: Hydra reconfigures handlers at startup."""
    factory = logging.getLogRecordFactory()
    if getattr(factory, "redacting", False):
        return

    def make_record(*args, **kwargs):
        record = factory(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is logging's own problem to report
            return record
        masked = mask_secrets(message)
        if masked != message:
            record.msg, record.args = masked, None
        return record

    make_record.redacting = True
    logging.setLogRecordFactory(make_record)


def mask_file(path: Path) -> None:
    """Mask secrets in a text file in place; a YAML file is rewritten through its parsed form, so that it stays
    valid YAML (a bare `***` would read as an alias)."""
    text = path.read_text()
    masked = mask_secrets(text)
    if masked == text:
        return
    if path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            masked = yaml.safe_dump(_mask_strings(yaml.safe_load(text)), sort_keys=False, allow_unicode=True)
        except yaml.YAMLError:
            pass
    path.write_text(masked)


def redact_hydra_files(hydra_cfg) -> None:
    """Mask secrets in the YAML files Hydra wrote before the job started: the job's .hydra/ (config, overrides,
    hydra) and a multirun's multirun.yaml."""
    files = []
    if hydra_cfg.output_subdir:
        files += Path(hydra_cfg.runtime.output_dir, hydra_cfg.output_subdir).glob("*.yaml")
    if str(hydra_cfg.mode) == "RunMode.MULTIRUN":
        files.append(Path(hydra_cfg.sweep.dir) / "multirun.yaml")
    for path in files:
        if path.is_file():
            mask_file(path)
