"""`tianji eval RUN_DIR`: play greedy episodes with a run's last checkpoint, print the score, and
optionally record the first episode as a video (MP4 or GIF).

    result = evaluate_run(Path("runs/pong-ppo-..."), episodes=10, video=Path("pong.mp4"))
    # {"episodes": 10, "mean": ..., "std": ..., "min": ..., "max": ..., "returns": [...], "video": ...}
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import gymnasium as gym
import numpy as np

from tianji.algos import get_algo
from tianji.algos.base import ActorPolicy, Placement
from tianji.config import Config, ConfigError
from tianji.envs.make import VectorEnvLike, is_atari, make_atari_screen, make_vector_env
from tianji.runtime.roles.evaluator import play_greedy
from tianji.runtime.shared.checkpoint import CheckpointError, CheckpointSets
from tianji.tools.train import load_run_config

VIDEO_FPS = 30
ATARI_FPS = 15  # 60 emulator frames a second, 4 to an agent step: real time


class ScreenTwin:
    """The evaluation's vector env, with a twin of its first env (`make_atari_screen`) stepped alongside on
    the same actions until that env's first episode ends, its colour screen recorded at every step."""

    def __init__(self, envs: VectorEnvLike, twin: VectorEnvLike, frames: list[np.ndarray]):
        self.envs, self.twin, self.frames = envs, twin, frames
        self.running = True

    def __getattr__(self, name: str) -> Any:  # num_envs, spaces, recorded_info, ...
        return getattr(self.envs, name)

    def reset(self, seed: int | None = None) -> tuple[Any, dict]:
        screen, _ = self.twin.reset(seed=seed)
        self.frames.append(screen[0, -1])
        self.running = True
        return self.envs.reset(seed=seed)

    def step(self, actions: np.ndarray) -> tuple:
        if self.running:
            screen, _, terminated, truncated, _ = self.twin.step(actions[:1])
            self.frames.append(screen[0, -1])
            self.running = not (terminated[0] or truncated[0])
        return self.envs.step(actions)

    def close(self) -> None:
        self.twin.close()
        self.envs.close()


def evaluate_run(
    run_dir: Path,
    episodes: int = 10,
    video: Path | None = None,
    seed: int = 12345,
    view: Literal["screen", "agent"] = "screen",
) -> dict[str, Any]:
    """`view` (Atari videos): the game's own screen in colour, or the frames the agent sees."""
    if episodes < 1:
        raise ConfigError("--episodes: expected at least 1")
    cfg = load_run_config(run_dir)
    good = CheckpointSets(run_dir / "checkpoints").newest_good()  # CheckpointError when there is none
    for line in good.skipped:
        print(f"warning: {line}; playing an older set", file=sys.stderr, flush=True)
    state = good.learner_state()
    if state is None:
        raise CheckpointError(f"{good.path}: no learner.pt in it")
    envs = make_vector_env(cfg.env, episodes, render=video is not None)
    frames: list[np.ndarray] = []
    fps = VIDEO_FPS
    try:
        policy = _policy(cfg, envs, state)
        recorder = None
        if video is not None and is_atari(cfg.env) and view == "screen":
            envs, fps = ScreenTwin(envs, make_atari_screen(cfg.env), frames), ATARI_FPS
        elif video is not None:
            recorder = _recorder(envs, frames)
        played = play_greedy(envs, policy, seed, recorder)
    finally:
        envs.close()
    returns = played.returns
    result = {
        "run_dir": str(run_dir),
        "policy_version": int(state["version"]),
        "episodes": episodes,
        "mean": float(returns.mean()),
        "std": float(returns.std()),
        "min": float(returns.min()),
        "max": float(returns.max()),
        "length_mean": float(played.lengths.mean()),
        "returns": [float(r) for r in returns],
    }
    if played.won is not None:
        result["win_rate"] = float(played.won.mean())
    if video is not None:
        result["video"] = str(write_video(frames, video, fps))
    return result


def _policy(cfg: Config, envs: VectorEnvLike, state: dict[str, Any]) -> ActorPolicy[Any]:
    spec = get_algo(cfg.algo.name)
    policy = spec.make_policy(cfg.algo, envs.single_observation_space, envs.single_action_space, Placement())
    policy.load_weights(spec.policy_weights(state["algo"]))  # each algorithm knows where its policy is
    return policy


def _recorder(envs: VectorEnvLike, frames: list[np.ndarray]) -> Callable[[Any, np.ndarray], None]:
    """Frames of the first env while its first episode runs: what the env renders (rgb_array), or,
    for envs that cannot render (Atari's native vector env), the newest frame the agent sees."""

    def record(obs: np.ndarray, running: np.ndarray) -> None:
        if not running[0]:
            return
        try:
            renders = getattr(envs, "render_mode", None) == "rgb_array"
            rendered = envs.render() if renders else None  # type: ignore[attr-defined]  # Gymnasium's vector envs
        except gym.error.DependencyNotInstalled as exc:
            raise ConfigError(f"--video: the env cannot render without an extra package: {exc}") from None
        first = None if isinstance(obs, dict) else obs[0]
        frames.append(np.asarray(rendered[0]) if rendered is not None else _frame_of(first))

    return record


def _frame_of(observation: Any) -> np.ndarray:
    """An image observation as an RGB frame (the last stacked frame, scaled up 4x)."""
    if not isinstance(observation, np.ndarray) or observation.ndim != 3:
        raise ConfigError("--video: this env neither renders rgb_array frames nor observes images")
    frame = observation[-1] if observation.shape[0] < observation.shape[-1] else observation[..., -1]
    frame = np.kron(frame.astype(np.uint8), np.ones((4, 4), np.uint8))
    return np.repeat(frame[..., None], 3, axis=2)


def write_video(frames: list[np.ndarray], path: Path, fps: float = VIDEO_FPS) -> Path:
    """MP4 (ffmpeg from the imageio-ffmpeg wheel) or GIF, chosen by the file's suffix."""
    try:
        import imageio.v2 as imageio
    except ImportError:
        raise ConfigError("--video needs imageio: pip install 'tianji[video]'") from None
    if path.suffix.lower() not in (".mp4", ".gif"):
        raise ConfigError(f"--video {path}: expected a .mp4 or .gif file")
    path.parent.mkdir(parents=True, exist_ok=True)
    even: list[Any] = [_even(f) for f in frames]
    if path.suffix.lower() == ".gif":
        imageio.mimsave(path, even, duration=1000 / fps, loop=0)
    else:
        imageio.mimsave(path, even, fps=fps, macro_block_size=1)
    return path


def _even(frame: np.ndarray) -> np.ndarray:
    """H.264 wants even sides."""
    h, w = frame.shape[:2]
    return np.ascontiguousarray(frame[: h - h % 2, : w - w % 2])
