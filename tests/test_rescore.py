"""`rescore`'s overrides: Hydra applies them to a run's resolved_config.yaml in training's grammar (the ledger tests
re-score a real run; these need only its config, so they run in seconds)."""

import pytest
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from grpo_pipeline.api import compose_config
from grpo_pipeline.errors import ConfigError
from grpo_pipeline.tools import rescore
from grpo_pipeline.tracking.redact import masked_config


@pytest.fixture
def run_dir(tmp_path):
    """A run dir's config as the recipe writes it, of a run with reward=step (so a group choice must replace it)."""
    cfg = compose_config(["model=tiny", "env=arithmetic", "reward=step", f"output_dir={tmp_path / 'run'}"])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "resolved_config.yaml").write_text(OmegaConf.to_yaml(masked_config(cfg)))
    return tmp_path / "run"


def test_a_group_choice_replaces_the_runs_section_and_keys_set_values(run_dir):
    cfg = rescore.run_config(run_dir, ["reward=length_penalty", "reward.components.length_penalty.weight=0.25",
                                       "env.format_weight=0.0", "env.operations=[+,-]", "+env.extra=1", "~env.seed"])
    assert list(cfg.reward.components) == ["length_penalty"]  # the run's `step` component does not linger
    assert cfg.reward.components.length_penalty.weight == 0.25 and cfg.reward.env_weight == 1.0
    assert cfg.env.format_weight == 0.0 and list(cfg.env.operations) == ["+", "-"] and cfg.env.extra == 1
    assert "seed" not in cfg.env
    assert cfg.model.name == "tiny" and cfg.env.answer_weight == 0.8  # the rest is the run's own config
    assert not GlobalHydra.instance().is_initialized()  # Hydra's global state is left as it was found


def test_no_overrides_is_the_runs_config(run_dir):
    cfg = rescore.run_config(run_dir, [])
    assert OmegaConf.to_container(cfg) == OmegaConf.to_container(OmegaConf.load(run_dir / "resolved_config.yaml"))


@pytest.mark.parametrize(("override", "says"), [
    ("reward", ["'reward'", "group=option (reward=length_penalty)"]),  # not key=value
    ("env.operations=[+", ["'env.operations=[+'", "Overrides are Hydra's"]),  # does not parse
    ("reward=nope", ["reward/nope", "length_penalty", "accuracy"]),  # no such option: the choices are listed
    ("env.format_weigth=0", ["env.format_weigth", "+env.format_weigth=0"]),  # a typo is not silently added
])
def test_a_bad_override_is_a_config_error_naming_it_and_the_fix(run_dir, override, says):
    with pytest.raises(ConfigError) as e:
        rescore.run_config(run_dir, [override])
    assert all(s in str(e.value) for s in says), str(e.value)
    assert not GlobalHydra.instance().is_initialized()


def test_the_cli_reports_a_bad_override_in_one_line_before_loading_anything(run_dir):
    with pytest.raises(SystemExit) as e:
        rescore.main([str(run_dir), "reward=nope"])
    assert str(e.value).startswith("ERROR: rescore reward=nope: ") and "Traceback" not in str(e.value)
