"""`tianji eval RUN_DIR`: greedy episodes with the last checkpoint, the score, a video."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tianji.runtime.shared.checkpoint import CheckpointError
from tianji.tools.evaluate import evaluate_run
from tianji.tools.train import train


def test_eval_plays_greedy_episodes_prints_the_score_and_records_a_video(tiny_config, tmp_path):
    pytest.importorskip("imageio")
    pytest.importorskip("pygame")
    run_dir, _ = train(tiny_config(max_env_steps=2048), "inline", run_dir=str(tmp_path / "run"))
    video = tmp_path / "episode.gif"
    result = subprocess.run(
        [sys.executable, "-m", "tianji", "eval", str(run_dir), "--episodes", "3", "--video", str(video)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "3 greedy episodes: mean" in result.stdout and "min" in result.stdout and "max" in result.stdout
    assert video.stat().st_size > 1000
    scores = evaluate_run(run_dir, episodes=3)
    assert len(scores["returns"]) == 3 and scores["min"] <= scores["mean"] <= scores["max"]


def test_eval_of_an_image_env_writes_an_mp4_from_what_the_agent_sees(tmp_path):
    pytest.importorskip("imageio_ffmpeg")
    from tianji.config import load_config

    cfg = load_config(
        "catch-impala",
        [f"logging.run_root={tmp_path}", "logging.console=false", "stop.target_return=null", "stop.max_env_steps=640"],
    )
    run_dir, _ = train(cfg, "inline", run_dir=str(tmp_path / "run"))
    result = evaluate_run(run_dir, episodes=2, video=tmp_path / "catch.mp4")
    assert (tmp_path / "catch.mp4").stat().st_size > 0 and result["episodes"] == 2


def test_eval_without_a_checkpoint_says_so(tmp_path, tiny_config):
    run_dir = tmp_path / "empty"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("name: x\n")
    with pytest.raises(CheckpointError, match="no checkpoint in .* yet"):
        evaluate_run(run_dir)


def test_eval_video_of_an_atari_run_shows_the_games_screen_in_colour(tmp_path):
    """The video is the game's own 210x160 colour screen, played by a twin env in step with the agent's
    first env (same seed, same actions); `view="agent"` records the agent's grey frames instead."""
    pytest.importorskip("ale_py")
    imageio = pytest.importorskip("imageio.v2")
    from tianji.config import load_config

    cfg = load_config(
        "pong-ppo",
        [
            f"logging.run_root={tmp_path}",
            "logging.console=false",
            "stop.target_return=null",
            "stop.max_env_steps=512",
            "topology.actors=1",
            "topology.envs_per_actor=4",
            "topology.fragment_length=32",
            "env.kwargs.max_num_frames_per_episode=400",
        ],
    )
    run_dir, _ = train(cfg, "inline", run_dir=str(tmp_path / "run"))
    screen = evaluate_run(run_dir, episodes=2, video=tmp_path / "screen.gif")
    frames = imageio.mimread(tmp_path / "screen.gif")
    assert frames[0].shape[:2] == (210, 160)
    colours = frames[len(frames) // 2][..., :3].reshape(-1, 3).astype(int)
    assert (colours.max(1) - colours.min(1)).max() > 50, "a grey picture"  # Pong's orange and green
    assert len(frames) > 20
    agent = evaluate_run(run_dir, episodes=2, video=tmp_path / "agent.gif", view="agent")
    agent_frames = imageio.mimread(tmp_path / "agent.gif")
    assert agent_frames[0].shape[:2] == (4 * 42 - (4 * 42) % 2, 4 * 42 - (4 * 42) % 2)
    assert agent["returns"] == screen["returns"]  # the same greedy games either way


def test_eval_plays_with_the_checkpoints_own_weights(tiny_config, tmp_path, monkeypatch):
    """The policy that plays is the checkpoint's: every weight equal to the newest set's learner.pt (and not
    to a policy made fresh, which a loader that loaded nothing would leave in place)."""
    import torch

    import tianji.tools.evaluate as evaluate_module

    from conftest import newest_set

    run_dir, _ = train(tiny_config(max_env_steps=2048), "inline", run_dir=str(tmp_path / "run"))
    saved = torch.load(newest_set(run_dir) / "learner.pt", weights_only=True)["algo"]["net"]
    played = {}
    real = evaluate_module.play_greedy

    def spy(envs, policy, seed, on_step=None):
        played.update({k: v.clone() for k, v in policy.net.state_dict().items()})
        return real(envs, policy, seed, on_step)

    monkeypatch.setattr(evaluate_module, "play_greedy", spy)
    evaluate_run(run_dir, episodes=2)
    assert played.keys() == saved.keys()
    assert all(torch.equal(played[k], saved[k]) for k in saved)
    untrained = torch.load(newest_set(run_dir) / "learner.pt", weights_only=True)["version"]
    assert untrained > 0  # the weights compared were trained, not the initial ones
