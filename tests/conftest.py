from __future__ import annotations

import importlib.util
import signal
import sys
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from tianji.config import build_config

REPO = Path(__file__).resolve().parents[1]

# The tests press Ctrl-C themselves (SIGINT to a run's process group). A suite started in the background by a
# non-interactive shell inherits SIGINT ignored, and so would every process it starts: catch it here instead
# (a caught signal, unlike an ignored one, is back to its default in a child after exec).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


class FakeVectorEnv:
    """k envs whose episodes last `episode_length` steps; obs = [step in episode, env index].

    Resets on the step after an episode ends (Gymnasium's next-step autoreset):
    that step returns the reset obs with reward 0 and no termination.
    """

    def __init__(self, num_envs: int = 3, episode_length: int = 4, truncate: bool = False):
        self.num_envs = num_envs
        self.episode_length = episode_length
        self.truncate = truncate
        self.single_observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
        self.single_action_space = gym.spaces.Discrete(2)
        self.t = np.zeros(num_envs, dtype=np.int64)
        self.needs_reset = np.zeros(num_envs, dtype=bool)
        self.actions: list[np.ndarray] = []

    def _obs(self) -> np.ndarray:
        return np.stack([self.t.astype(np.float32), np.arange(self.num_envs, dtype=np.float32)], axis=1)

    def reset(self, seed=None):
        self.t[:] = 0
        return self._obs(), {}

    def step(self, actions):
        self.actions.append(np.asarray(actions))
        reward = np.where(self.needs_reset, 0.0, 1.0).astype(np.float32)
        self.t = np.where(self.needs_reset, 0, self.t + 1)
        ended = (self.t >= self.episode_length) & ~self.needs_reset
        terminated = ended & (not self.truncate)
        truncated = ended & self.truncate
        self.needs_reset = ended
        return self._obs(), reward, terminated, truncated, {}

    def close(self):
        pass


class FakePolicy:
    """Records a constant per-step extra; actions alternate; weights are a single 'w' array."""

    def __init__(self):
        self.w = np.zeros(1, np.float32)

    def load_weights(self, weights):
        self.w = np.array(weights["w"], copy=True)

    def act(self, obs):
        actions = obs[:, 0].astype(np.int64) % 2
        return actions, {"action": actions, "w_used": np.full(len(obs), self.w[0], np.float32)}

    def greedy(self, obs):
        return np.zeros(len(obs), np.int64)

    def finish_fragment(self, fragment, last_obs):
        return {"last_t": last_obs[:, 0].copy()}


class FakeAlgoLearner:
    holds_fragments = True  # keeps fragments (views of shared memory) until its update

    def __init__(self, batch_fragments: int = 1):
        self.batch_fragments = batch_fragments
        self.pending = []
        self.w = np.zeros(1, np.float32)
        self.updates = 0

    def add(self, fragment):
        self.pending.append(fragment)

    def wants_data(self):
        return len(self.pending) < self.batch_fragments

    def ready(self):
        return len(self.pending) >= self.batch_fragments

    def update(self):
        self.pending = []
        self.w = self.w + 1
        self.updates += 1
        return {"loss": 1.0}

    def samples_per_update(self):
        return 6

    def weights(self):
        return {"w": self.w.copy()}

    def state_dict(self):
        return {"w": self.w.copy()}

    def load_state_dict(self, state):
        self.w = state["w"]


@pytest.fixture
def tiny_config(tmp_path):
    """A CartPole PPO config that runs a few seconds and writes under tmp_path."""

    def make(**stop):
        return build_config(
            {
                "name": "test",
                "topology": {"actors": 1, "envs_per_actor": 4, "fragment_length": 16},
                "algo": {"name": "ppo", "epochs": 1, "minibatches": 1},
                "stop": stop or {"max_env_steps": 2048},
                "logging": {"run_root": str(tmp_path / "runs"), "console": False, "interval_s": 0.2},
                "checkpoint": {"interval_s": 0.5},
            }
        )

    return make


def child_pids(pid: int) -> set[int]:
    found, frontier = set(), [pid]
    while frontier:
        p = frontier.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = {int(c) for c in (task / "children").read_text().split()}
            except OSError:
                continue
            frontier.extend(kids - found)
            found |= kids
    return found


def wait_for(predicate, seconds: float) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def newest_set(run_dir: Path) -> Path:
    """The newest checkpoint set of a run that verifies (run_dir/checkpoints/set-NNNNNN)."""
    from tianji.runtime.shared.checkpoint import CheckpointSets

    return CheckpointSets(run_dir / "checkpoints").newest_good().path


def has_set(run_dir: Path) -> bool:
    try:
        newest_set(run_dir)
        return True
    except ValueError:  # CheckpointError: nothing written yet
        return False


def assert_lag_bounded(summary: dict, bound: int, max_dropped_fraction: float = 0.0) -> None:
    """The lag bound held where it can fail. The learner drops a fragment over the bound, so the lag of what
    was trained is within it by construction; what the credits granted is what must stay within it: nothing
    dropped (off-policy, where updates per fragment vary, at most `max_dropped_fraction`), and every fragment
    trained within the bound."""
    dropped, trained = summary["fragments_dropped"], summary["fragments_trained"]
    assert trained > 0
    assert dropped <= max_dropped_fraction * (dropped + trained), summary["dropped_lag_histogram"]
    assert max(int(lag) for lag in summary["policy_lag_histogram"]) <= bound, summary["policy_lag_histogram"]


def load_benchmark(monkeypatch, name: str):
    """benchmarks/NAME.py imported as a module (its folder on sys.path for its own `common` import)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up while defined
    spec.loader.exec_module(module)
    return module
