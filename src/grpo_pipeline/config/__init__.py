"""Config schemas, validation and the mapping onto TRL's GRPOConfig."""

from pathlib import Path

# The YAML config groups: packaged inside the wheel, or the repository's conf/ in a checkout.
_PACKAGED = Path(__file__).resolve().parent.parent / "conf"
CONFIG_DIR = _PACKAGED if _PACKAGED.is_dir() else Path(__file__).resolve().parents[3] / "conf"
