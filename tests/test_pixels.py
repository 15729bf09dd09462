"""Pixels end to end: networks chosen by observation, uint8 until the network's first layer, rows
written straight into shared memory, Atari through ale-py, a pixel game that learns."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from tianji.algos.common.correction import NO_GRAD_PASS_ELEMENTS, evaluate_steps
from tianji.algos.common.networks import NATURE_CONVS, SMALL_CONVS, NatureCNN, PolicyValueNet, choose_model, pixels_seen
from tianji.config import ConfigError, apply_overrides, build_config, load_config, load_raw
from tianji.envs.make import make_vector_env
from tianji.runtime.roles.build import build_actor, build_learner
from tianji.runtime.transport.shm import SlotReader, SlotWriter, pool_path, remove_pools
from tianji.tools.train import train

from conftest import newest_set


def test_nature_cnn_takes_frames_first_or_last_and_gives_512_features():
    first = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
    last = gym.spaces.Box(0, 255, (84, 84, 4), np.uint8)
    assert NatureCNN(first)(torch.zeros(2, 4, 84, 84, dtype=torch.uint8)).shape == (2, 512)
    assert NatureCNN(last)(torch.zeros(2, 84, 84, 4, dtype=torch.uint8)).shape == (2, 512)
    net = PolicyValueNet(first, gym.spaces.Discrete(6), hidden=[64], model="auto")
    logits, value = net(torch.zeros(3, 4, 84, 84, dtype=torch.uint8))
    assert logits.shape == (3, 6) and value.shape == (3,) and net.shared
    assert choose_model(gym.spaces.Box(-1, 1, (4,)), "auto") == "mlp"
    with pytest.raises(ValueError, match="algo.model 'cnn' needs image observations"):
        choose_model(gym.spaces.Box(-1, 1, (4,)), "cnn")


@pytest.mark.parametrize("size", [42, 40])  # 40: padded at the bottom and right
def test_frames_become_scaled_floats_in_the_convolutions_layout_and_float_input_is_left_alone(size):
    frames = torch.randint(0, 256, (3, 4, size, size), dtype=torch.uint8)
    cnn = NatureCNN(gym.spaces.Box(0, 255, (4, size, size), np.uint8), convs=((16, 4, 2), (32, 4, 2), (32, 3, 1)))
    x = cnn._frames(frames)
    reference = torch.nn.functional.pad(frames.float() / 255, cnn.padding)
    assert x.dtype == torch.float32 and x.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(x, reference, atol=1e-7)
    floats = torch.rand(3, 4, size, size).contiguous(memory_format=torch.channels_last)
    before = floats.clone()
    NatureCNN(gym.spaces.Box(0.0, 1.0, (4, size, size), np.float32))._frames(floats).mul_(2)
    assert torch.equal(floats, before), "the caller's observations are not scaled in place"


def catch_config(**algo):
    return load_config("catch-impala", [f"algo.{k}={v}" for k, v in algo.items()])


def test_frames_stay_uint8_until_the_learners_forward(tmp_path):
    cfg = catch_config()
    actor = build_actor(cfg, 0)
    learner = build_learner(cfg)
    seen = []
    original = learner.algo.net.body.forward

    def recording(obs):
        seen.append(obs.dtype)
        return original(obs)

    learner.algo.net.body.forward = recording
    first = actor.collect()
    assert first.arrays["obs"].dtype == np.uint8 and first.arrays["last_obs"].dtype == np.uint8
    writer = SlotWriter(pool_path("pixeltest", "actor0"), slots=1)
    try:
        header = writer.write(0, first.arrays)
        views = writer.views(0)
        second = actor.collect(out=views)  # rows written in place: the fragment *is* the slot
        assert second.arrays is views and np.shares_memory(second.arrays["obs"], views["obs"])
        arrays = SlotReader("tianji-pixeltest-").read(writer.header(0))
        assert arrays["obs"].dtype == np.uint8 and np.array_equal(arrays["obs"], second.arrays["obs"])
        assert header["fields"][0][:2] == ["obs", "|u1"]
        learner.consume(second.__class__(arrays, 0, 1, 0, second.env_steps))
        learner.update()
    finally:
        writer.close()
        remove_pools("pixeltest")
    assert seen and all(dtype == torch.uint8 for dtype in seen), seen


def test_atari_needs_its_extra_and_names_the_game(monkeypatch):
    import sys

    cfg = build_config({"env": {"id": "ALE/NoSuchGame-v5"}})
    with pytest.raises(ConfigError, match="ale-py has no game 'no_such_game'"):
        make_vector_env(cfg.env, 1)
    monkeypatch.setitem(sys.modules, "ale_py", None)
    with pytest.raises(ConfigError, match=r"needs ale-py: pip install 'tianji\[atari\]'"):
        make_vector_env(build_config({"env": {"id": "ALE/Pong-v5"}}).env, 1)


IMPALA_PONG = {"name": "impala", "model": "cnn_small", "init": "orthogonal"}


@pytest.mark.parametrize("algo, learners", [(None, 1), (IMPALA_PONG, 2)])
def test_pong_runs_end_to_end_with_the_real_emulator(algo, learners, tmp_path):
    """pong-ppo as it is, and IMPALA on the same frames with a group of two learners."""
    pytest.importorskip("ale_py")
    raw = load_raw("pong-ppo")
    if algo is not None:
        raw["algo"] = algo
    raw = apply_overrides(
        raw,
        [
            f"logging.run_root={tmp_path}",
            "logging.console=false",
            "stop.target_return=null",
            "stop.max_env_steps=2560",
            "topology.envs_per_actor=8",
            "topology.fragment_length=20",
            f"topology.learners={learners}",
        ],
    )
    cfg = build_config(raw)
    envs = make_vector_env(cfg.env, 2)
    assert envs.single_observation_space.shape == (4, 42, 42) and envs.single_observation_space.dtype == np.uint8
    envs.close()
    run_dir, summary = train(cfg, "local")
    assert summary["env_steps"] >= 2560 and summary["updates"] >= 1 and summary["fragments_dropped"] == 0
    assert (newest_set(run_dir) / "learner.pt").exists()


@pytest.mark.slow
def test_impala_learns_a_pixel_game(tmp_path):
    cfg = load_config("catch-impala", [f"logging.run_root={tmp_path}", "logging.console=false"])
    _, summary = train(cfg, "local")
    assert summary["target_reached"], summary
    assert summary["return_at_target"] >= 0.8


def test_dead_units_counts_trunk_outputs_that_are_zero_on_every_frame():
    space = gym.spaces.Box(0, 255, (4, 42, 42), np.uint8)
    net = PolicyValueNet(space, gym.spaces.Discrete(6), [], "cnn_small", "orthogonal")
    frames = torch.randint(0, 256, (8, 4, 42, 42), dtype=torch.uint8)
    assert net.dead_units is None, "nothing trained yet"
    net.value(frames)
    assert 0.0 <= net.dead_units < 0.5, "a fresh orthogonal trunk is mostly alive"
    fc = net.body.fc[0]
    with torch.no_grad():
        fc.bias[:] = 1e6  # every unit fires
    net.value(frames)
    assert net.dead_units == 0.0
    with torch.no_grad():
        fc.bias[: fc.out_features // 4] = -1e6  # a quarter of the units can never fire
    net.value(frames)
    assert net.dead_units == 0.25
    with torch.no_grad():
        fc.bias[:] = -1e6
        net.value(frames)  # acting (no gradient) leaves the training figure alone
    assert net.dead_units == 0.25


def test_learner_device_auto_is_the_cpu_here_and_cuda_must_exist():
    from tianji.algos.common.tensors import resolve_device

    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="learner.device is 'cuda' but torch sees no CUDA device"):
            resolve_device("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("preset", ["catch-impala", "cartpole-ppo", "cartpole-dqn"])
def test_a_cuda_learner_trains_on_cpu_actors_data(preset):
    cfg = load_config(
        preset, ["learner.device=cuda", "algo.learning_starts=0"] if "dqn" in preset else ["learner.device=cuda"]
    )
    actor, learner = build_actor(cfg, 0), build_learner(cfg)
    assert next(learner.algo.net.parameters()).is_cuda
    while not learner.ready():
        learner.consume(actor.collect())
    learner.update()
    weights = learner.weights()
    assert all(isinstance(w, np.ndarray) for w in weights.values())
    actor.set_weights(learner.version, weights)


def test_unpadded_convolutions_lose_the_last_rows_where_strides_do_not_fit():
    assert [pixels_seen(size, NATURE_CONVS) for size in (36, 40, 42, 44, 84)] == [36, 36, 36, 44, 84]
    assert [pixels_seen(size, SMALL_CONVS) for size in (40, 42, 44)] == [36, 36, 44]


@pytest.mark.parametrize("model", ["cnn", "cnn_small"])
@pytest.mark.parametrize("size", [40, 42, 84])
def test_every_pixel_of_the_frame_reaches_the_trunk(model, size):
    """Catch (40x40) and Pong at 42x42 put the paddle in the last rows or columns, which unpadded
    strided convolutions never read: the trunk pads the frame so that every pixel changes its output."""
    space = gym.spaces.Box(0, 255, (4, size, size), np.uint8)
    net = PolicyValueNet(space, gym.spaces.Discrete(3), [], model, "orthogonal")
    frames = torch.rand(2, 4, size, size, requires_grad=True)
    net.body(frames).pow(2).sum().backward()
    seen = frames.grad.abs().sum((0, 1)) > 0
    assert seen.all(), f"pixels never read: rows {(~seen).any(1).nonzero().flatten().tolist()}"


@pytest.mark.parametrize("crop, pool", [((14, 78, 0, 84), 2), (None, 3), ((1, 9, 2, 7), 1)])
def test_frame_view_crops_and_max_pools_every_frame(crop, pool):
    """env.crop / env.pool: the kept block of each stacked frame, max-pooled (the reference: reshape + max)."""
    from tianji.envs.make import FrameView

    class Frames(gym.vector.VectorEnv):
        metadata = {"autoreset_mode": gym.vector.AutoresetMode.NEXT_STEP}
        num_envs = 3
        single_observation_space = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)

    obs = np.random.default_rng(0).integers(0, 256, (3, 4, 84, 84), dtype=np.uint8)
    view = FrameView(Frames(), crop, pool)
    top, bottom, left, right = crop or (0, 84, 0, 84)
    h, w = (bottom - top) // pool, (right - left) // pool
    kept = obs[:, :, top : top + h * pool, left : left + w * pool]
    expected = kept.reshape(3, 4, h, pool, w, pool).max(axis=(3, 5))
    np.testing.assert_array_equal(view.observations(obs), expected)
    assert view.single_observation_space.shape == (4, h, w)


def test_pongs_ball_keeps_its_contrast_when_pooled_not_resized():
    """The reason for env.pool: at 42x42 ale-py's resize averages Pong's 2-pixel ball into the background;
    pooled from 84x84 it stays bright."""
    pytest.importorskip("ale_py")
    from tianji.envs.config import EnvConfig
    from tianji.envs.make import make_vector_env

    def brightest_in_play(cfg: EnvConfig) -> list[int]:
        envs = make_vector_env(cfg, 1)
        obs, _ = envs.reset(seed=3)
        rng, peaks = np.random.default_rng(0), []
        for _ in range(150):
            obs, *_ = envs.step(rng.integers(0, 6, 1))
            field = obs[0, -1, int(0.2 * obs.shape[2]) : int(0.9 * obs.shape[2])]  # below the score, above the wall
            peaks.append(int(field.max()) - 87)  # 87: the background's grey
        envs.close()
        return peaks

    resized = brightest_in_play(EnvConfig(id="ALE/Pong-v5", kwargs={"img_height": 42, "img_width": 42}))
    pooled = brightest_in_play(EnvConfig(id="ALE/Pong-v5", crop=(14, 78, 0, 84), pool=2))
    assert np.median(pooled) > 1.5 * np.median(resized), (np.median(pooled), np.median(resized))


def test_a_trunk_of_its_own_convolutions_reads_every_pixel_and_trains():
    """algo.conv / algo.conv_features: the trunk the config names, padded so that no pixel is lost."""
    obs = gym.spaces.Box(0, 255, (4, 42, 42), np.uint8)
    conv = [(16, 4, 2), (32, 4, 2), (32, 3, 1)]
    net = PolicyValueNet(obs, gym.spaces.Discrete(6), [], "cnn", "orthogonal", conv, 128)
    layers = [m for m in net.body.conv if isinstance(m, torch.nn.Conv2d)]
    assert [(m.out_channels, m.kernel_size[0], m.stride[0]) for m in layers] == conv
    assert net.body.fc[0].out_features == 128 and net.pi.in_features == 128
    assert pixels_seen(42 + net.body.padding[1], tuple(conv)) >= 42
    logits, value = net(torch.randint(0, 255, (3, 4, 42, 42), dtype=torch.uint8))
    assert logits.shape == (3, 6) and value.shape == (3,)
    cfg = build_config(
        {"env": {"id": "ALE/Pong-v5"}, "algo": {"name": "ppo", "conv": [[16, 4, 2]], "conv_features": 64}}
    )
    assert cfg.algo.conv == [(16, 4, 2)] and cfg.algo.conv_features == 64


def test_the_targets_pass_over_a_batch_of_frames_runs_in_cache_sized_passes_with_the_same_outputs():
    """Without gradient, frames go through the net a few hundred at a time (1,024 Pong frames in one pass
    were 1.3x slower); with gradient, and for vector observations, in one pass."""
    frames = gym.spaces.Box(0, 255, (42, 42, 4), np.uint8)
    net = PolicyValueNet(frames, gym.spaces.Discrete(6), hidden=[], model="cnn", init="orthogonal")
    sizes: list[int] = []
    evaluate = net.evaluate
    net.evaluate = lambda obs, action: sizes.append(len(obs)) or evaluate(obs, action)  # type: ignore[method-assign]
    obs = torch.randint(0, 256, (128, 8, 42, 42, 4), dtype=torch.uint8)
    action = torch.randint(0, 6, (128, 8))
    whole = evaluate(obs.reshape(1024, 42, 42, 4), action.reshape(1024))
    with torch.no_grad():
        passes = evaluate_steps(net, obs, action)
    assert len(sizes) > 1 and max(sizes) <= NO_GRAD_PASS_ELEMENTS // (42 * 42 * 4) and sum(sizes) == 1024
    for split, one in zip(passes, whole, strict=True):
        assert split.shape == (128, 8)
        torch.testing.assert_close(split.reshape(1024), one.detach(), rtol=1e-5, atol=1e-5)
    sizes.clear()
    evaluate_steps(net, obs[:4], action[:4])
    assert sizes == [32]
    vectors = PolicyValueNet(gym.spaces.Box(-1, 1, (4,)), gym.spaces.Discrete(2), hidden=[8])
    with torch.no_grad():
        assert evaluate_steps(vectors, torch.zeros(512, 16, 4), torch.zeros(512, 16))[0].shape == (512, 16)
