"""The user's own environments: `module:EnvId`, `env.entry_point`, and the errors that name the field."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tianji.config import ConfigError, build_config
from tianji.envs.make import check_env, make_vector_env
from tianji.tools.train import check_env_and_algo

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "custom_env"


def test_the_docs_show_the_example_files_verbatim():
    page = (REPO / "docs" / "environments.md").read_text()
    for name in ("myenvs.py", "gridwalk.yaml"):
        assert (EXAMPLE / name).read_text() in page, f"docs/environments.md's copy of {name} is out of date"


def train_example(tmp_path: Path, *overrides: str) -> dict:
    """`tianji train` on the example YAML as a fresh command, the module found through PYTHONPATH only."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(EXAMPLE)}
    command = [
        sys.executable,
        "-m",
        "tianji",
        "train",
        str(EXAMPLE / "gridwalk.yaml"),
        "--run-dir",
        str(run_dir),
        "--set",
        "logging.console=false",
    ]
    for item in overrides:
        command += ["--set", item]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads((run_dir / "summary.json").read_text())


def test_registered_by_module_id_trains_to_target(tmp_path):
    summary = train_example(tmp_path)
    assert summary["target_reached"] and summary["return_at_target"] >= 0.9


def test_entry_point_form_trains_to_target(tmp_path):
    summary = train_example(tmp_path, "env.id=null", "env.entry_point=myenvs:GridWalk", "env.kwargs.size=6")
    assert summary["target_reached"]


def _step_fresh(cfg_json: str, result) -> None:
    envs = make_vector_env(build_config(json.loads(cfg_json)).env, 2)
    envs.reset(seed=0)
    result.put(envs.single_observation_space.shape)


def test_a_fresh_process_imports_the_module_itself(monkeypatch):
    """A role started fresh (spawn; later, on another machine) has not inherited the driver's import."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    cfg = build_config({"env": {"id": "myenvs:GridWalk-v0"}})
    ctx = multiprocessing.get_context("spawn")
    result = ctx.Queue()
    process = ctx.Process(target=_step_fresh, args=(json.dumps(cfg.model_dump(mode="json")), result))
    process.start()
    assert result.get(timeout=60) == (1,)
    process.join(10)
    assert process.exitcode == 0


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    """Importable modules written by the test."""

    def write(name: str, source: str) -> None:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))

    monkeypatch.syspath_prepend(str(tmp_path))
    return write


def env_config(**env):
    return build_config({"env": env})


def test_a_module_that_cannot_be_imported_is_named_with_its_error(user_modules):
    user_modules("broken_envs", "import no_such_dependency\n")
    with pytest.raises(ConfigError, match=r"env.id: cannot import module 'broken_envs' .*no_such_dependency"):
        check_env(env_config(id="broken_envs:Thing-v0").env)
    with pytest.raises(ConfigError, match=r"env.entry_point: cannot import module 'broken_envs'"):
        check_env(env_config(entry_point="broken_envs:Thing").env)


def test_an_id_the_module_did_not_register_names_what_it_did(user_modules):
    user_modules(
        "few_envs",
        """
        import gymnasium as gym
        gym.register("FewEnvsA-v0", entry_point="gymnasium.envs.classic_control:CartPoleEnv")
        gym.register("FewEnvsB-v0", entry_point="few_envs:Nothing")
    """,
    )
    with pytest.raises(
        ConfigError,
        match=r"env.id: module 'few_envs' was imported but registered no environment "
        r"'Missing-v0'; it registered FewEnvsB-v0",
    ):
        check_env(env_config(id="few_envs:Missing-v0").env)


def test_a_factory_must_return_a_gymnasium_env(user_modules):
    user_modules(
        "not_envs",
        """
        def make(size=3):
            return [0] * size
        VALUE = 3
    """,
    )
    cfg = env_config(entry_point="not_envs:make", kwargs={"size": 2}).env
    with pytest.raises(
        ConfigError, match=r"env.entry_point: 'not_envs:make' returned a list, expected a gymnasium.Env"
    ):
        make_vector_env(cfg, 2)
    with pytest.raises(ConfigError, match=r"env.entry_point: 'not_envs:VALUE' is a int"):
        check_env(env_config(entry_point="not_envs:VALUE").env)
    with pytest.raises(ConfigError, match=r"env.entry_point: module 'not_envs' has no attribute 'other'"):
        check_env(env_config(entry_point="not_envs:other").env)


def test_spaces_an_algorithm_cannot_take_are_named():
    cfg = build_config({"env": {"id": "Pendulum-v1"}, "algo": {"name": "dqn"}})
    with pytest.raises(
        ConfigError,
        match=r"env.id 'Pendulum-v1': algo.name 'dqn' cannot train on it: "
        r"DQN needs a Discrete action space",
    ):
        check_env_and_algo(cfg)


def test_id_and_entry_point_are_exclusive_and_entry_point_is_checked():
    with pytest.raises(ConfigError, match=r"env: set env.id or env.entry_point, not both"):
        env_config(id="CartPole-v1", entry_point="myenvs:GridWalk")
    with pytest.raises(ConfigError, match=r"env.entry_point: expected 'package.module:factory'"):
        env_config(entry_point="myenvs.GridWalk")
    assert env_config().env.id == "CartPole-v1"
    assert env_config(entry_point="myenvs:GridWalk").env.id is None
