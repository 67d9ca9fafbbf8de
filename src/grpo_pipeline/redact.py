"""Keep credentials written into URLs (`scheme://user:password@host`) out of everything we write.

`mask_credentials` is applied to what reaches MLflow (params, tags, run names, artifacts), to the files in
the run dir (resolved_config.yaml, Hydra's .hydra/*.yaml) and, through `redact_log_records`, to every log
line. No heavy imports here: the CLI uses it before torch loads.
"""

import logging
import re
from pathlib import Path

# Everything between "://" and the last "@" before the host: a password may itself contain "@".
_URL_CREDENTIALS = re.compile(r"://[^/\s'\"]*@")


def mask_credentials(text: str) -> str:
    """scheme://user:p@ss@host -> scheme://***@host"""
    return _URL_CREDENTIALS.sub("://***@", text)


def redact_log_records() -> None:
    """Mask URL credentials in every log record from now on, whichever handler writes it (console, Hydra's
    job log file). A record factory, not a handler filter: Hydra reconfigures handlers at startup."""
    factory = logging.getLogRecordFactory()
    if getattr(factory, "redacting", False):
        return

    def make_record(*args, **kwargs):
        record = factory(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is logging's own problem to report
            return record
        masked = mask_credentials(message)
        if masked != message:
            record.msg, record.args = masked, None
        return record

    make_record.redacting = True
    logging.setLogRecordFactory(make_record)


def redact_hydra_files(hydra_cfg) -> None:
    """Mask credentials in the YAML files Hydra wrote before the job started: the job's .hydra/ (config,
    overrides, hydra) and a multirun's multirun.yaml."""
    files = []
    if hydra_cfg.output_subdir:
        files += Path(hydra_cfg.runtime.output_dir, hydra_cfg.output_subdir).glob("*.yaml")
    if str(hydra_cfg.mode) == "RunMode.MULTIRUN":
        files.append(Path(hydra_cfg.sweep.dir) / "multirun.yaml")
    for path in files:
        if path.is_file():
            text = path.read_text()
            masked = mask_credentials(text)
            if masked != text:
                path.write_text(masked)
