"""Typed config: presets, overrides, and errors that name the field."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from tianji.config import ConfigError, build_config, describe_fields, load_config, preset_names, to_yaml


def test_presets_load_and_round_trip_through_yaml():
    assert "cartpole-ppo" in preset_names()
    for name in preset_names():
        cfg = load_config(name)
        assert build_config(yaml.safe_load(to_yaml(cfg))) == cfg


def test_overrides_are_typed():
    cfg = load_config(
        "cartpole-ppo", ["topology.actors=3", "algo.lr=0.01", "stop.target_return=null", "algo.hidden=[32, 32]"]
    )
    assert cfg.topology.actors == 3 and cfg.algo.lr == 0.01 and cfg.stop.target_return is None
    assert cfg.algo.hidden == [32, 32]


@pytest.mark.parametrize(
    "override, field, expected",
    [
        ("algo.lrr=1", "algo.lrr", "unknown field"),
        ("topology.actors=two", "topology.actors", "integer"),
        ("topology.actors=0", "topology.actors", "greater than or equal to 1"),
        ("algo.gamma=1.5", "algo.gamma", "less than or equal to 1"),
        ("balance.max_inflight=-1", "balance.max_inflight", "greater than or equal to 1"),
        ("algo.name=nope", "algo", "ppo"),
    ],
)
def test_bad_values_name_the_field_and_the_expectation(override, field, expected):
    with pytest.raises(ConfigError) as info:
        load_config("cartpole-ppo", [override])
    message = str(info.value)
    assert f"{field}:" in message and expected in message


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["algo.trace_cut=true"], "algo.trace_cut is true but algo.stale_correction is false"),
        (["algo.clip_anchor=both"], "algo.clip_anchor is 'both' but algo.stale_correction is false"),
        (["balance.publish_delay_varies=true"], "balance.publish_delay_varies is true but balance.publish_delay is 0"),
    ],
)
def test_settings_that_would_do_nothing_are_refused(overrides, named):
    """cartpole-ppo runs without the stale-fragment correction: its parts, and a delay drawn from 0..0, would be
    ignored silently."""
    with pytest.raises(ConfigError, match=named):
        load_config("cartpole-ppo", overrides)
    assert load_config("cartpole-ppo", [*overrides, "algo.stale_correction=true", "balance.publish_delay=2"])


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ConfigError, match="cartpole-ppo"):
        load_config("no-such-preset")


def test_every_field_is_documented():
    rows = describe_fields()
    assert {"seed", "env.id", "algo.lr", "topology.actors", "balance.max_policy_lag", "stop.target_return"} <= {
        key for key, _, _ in rows
    }
    assert all(doc for _, _, doc in rows)


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "tianji", *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_cli_rejects_bad_config_with_exit_code_and_field(tmp_path):
    result = run_cli("train", "cartpole-ppo", "--set", "topology.envs_per_actor=-4", cwd=tmp_path)
    assert result.returncode == 2
    assert "topology.envs_per_actor" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_cli_rejects_unknown_env_id(tmp_path):
    result = run_cli("train", "cartpole-ppo", "--set", "env.id=NoSuchEnv-v9", cwd=tmp_path)
    assert result.returncode == 2
    assert "env.id" in result.stderr and "NoSuchEnv-v9" in result.stderr


def test_cli_rejects_bad_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("topology: [1, 2\n")
    result = run_cli("train", str(path), cwd=tmp_path)
    assert result.returncode == 2 and "not valid YAML" in result.stderr


def test_cli_help_lists_config_fields():
    result = run_cli("train", "--help")
    assert result.returncode == 0
    assert "balance.max_policy_lag" in result.stdout and "Fragments produced more than" in result.stdout


@pytest.mark.parametrize(
    "algo, old, new",
    [
        ("ppo", ("proximal", False), ("stale_correction", False)),
        ("ppo", ("normalize_advantages", False), ("advantage_norm", "none")),
        ("mappo", ("proximal", False), ("stale_correction", False)),
        ("appo", ("proximal", False), ("clip_anchor", "behaviour")),
        ("appo", ("normalize_advantages", True), ("advantage_norm", "standard")),
    ],
)
def test_renamed_keys_still_load_for_one_release_with_a_warning_naming_the_new_one(algo, old, new):
    key, value = new
    with pytest.warns(FutureWarning, match=f"algo.{old[0]} is renamed algo.{key}"):
        cfg = build_config({"algo": {"name": algo, old[0]: old[1]}})
    assert getattr(cfg.algo, key) == value


def test_an_old_key_beside_its_new_name_is_refused():
    with pytest.raises(ConfigError, match="algo.proximal is the old name of algo.stale_correction"):
        load_config("cartpole-ppo", ["algo.proximal=true"])  # the preset sets algo.stale_correction


def test_an_old_value_with_no_new_counterpart_is_refused():
    with pytest.raises(ConfigError, match="algo.proximal .now algo.clip_anchor. is 'sometimes'"):
        build_config({"algo": {"name": "appo", "proximal": "sometimes"}})


def test_the_lag_bound_is_a_number_or_auto():
    auto = load_config("cartpole-ppo", ["balance.max_policy_lag=auto", "balance.lag_start=2"]).balance
    assert auto.lag_is_auto and auto.bound_at_start == 2 and auto.slots_per_actor == 4
    fixed = load_config("cartpole-ppo", ["balance.max_policy_lag=3", "balance.max_inflight=2"]).balance
    assert not fixed.lag_is_auto and fixed.bound_at_start == 3 and fixed.slots_per_actor == 2
    for bad in ("often", "-1"):
        with pytest.raises(ConfigError, match="balance.max_policy_lag"):
            load_config("cartpole-ppo", [f"balance.max_policy_lag={bad}"])
