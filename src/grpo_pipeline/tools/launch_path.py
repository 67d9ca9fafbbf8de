"""`python -m grpo_pipeline.<tool>` puts the working directory first on sys.path, so a `json.py` or `my_env.py`
lying there would shadow what the tool imports. Every command-line entry point drops it; the env loader adds the
launch dir back only while it imports the env (envs/loader.importable_from)."""

import os
import sys


def drop_launch_dir() -> None:
    if sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]
