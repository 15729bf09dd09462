"""One training run of a peer system (RLlib or Stable-Baselines3) on one task, timed like `tianji train`:
from this process's start, imports included, to the target or the cap. `benchmarks/peers.py` runs it.

    python benchmarks/peers_run.py --system sb3 --task cartpole-ppo --seed 0 --cap-s 300 --out result.json

Each peer trains with its own published tuned settings: RLlib's tuned examples (rllib/tuned_examples,
written out below: the wheel does not ship them) and the rl-baselines3-zoo hyperparameter files (read from
the installed rl_zoo3 package; its schedules run over its n_timesteps as published, then, short of the
target, training goes on at their final values unless its learning rate ended at 0). Progress lines
(seconds, env steps, the task's metric) go to stdout as JSON; the result (reached, seconds and env steps
to it or to the cap, thresholds passed on the way) to --out.
"""

from __future__ import annotations

import time

T0 = time.time()  # the command's start: what every system's time to target counts from

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

TASKS = {  # task -> (env id, algorithm, metric, target, extra thresholds reported on the way)
    "cartpole-ppo": ("CartPole-v1", "ppo", "train_mean100", 475.0, ()),
    "cartpole-dqn": ("CartPole-v1", "dqn", "greedy_eval20", 475.0, ()),
    "acrobot-ppo": ("Acrobot-v1", "ppo", "train_mean100", -100.0, ()),
    "pong-ppo": ("PongNoFrameskip-v4", "ppo", "train_mean100", 18.0, (-15.0, 0.0, 12.0)),
    "pong-appo": ("PongNoFrameskip-v4", "appo", "train_mean100", 18.0, (-15.0, 0.0, 12.0)),
}


@dataclass
class Progress:
    """What a run reports: the metric over time, the first time each threshold was passed."""

    target: float
    thresholds: tuple[float, ...]
    cap_s: float
    points: list[tuple[float, int, float]] = field(default_factory=list)
    reached: dict[str, tuple[float, int]] = field(default_factory=dict)
    last_shown: float = 0.0

    def report(self, env_steps: int, value: float | None) -> bool:
        """Record a point; True when the run should stop (target reached or cap spent)."""
        elapsed = time.time() - T0
        if value is not None and value == value:
            if not self.points or elapsed - self.points[-1][0] >= 1.0 or value != self.points[-1][2]:
                self.points.append((elapsed, int(env_steps), float(value)))
            if elapsed - self.last_shown >= 5.0:
                print(json.dumps({"s": round(elapsed, 2), "env_steps": int(env_steps), "value": value}), flush=True)
                self.last_shown = elapsed
            for threshold in (*self.thresholds, self.target):
                if value >= threshold and str(threshold) not in self.reached:
                    self.reached[str(threshold)] = (elapsed, int(env_steps))
        return self.done()

    def done(self) -> bool:
        return str(self.target) in self.reached or time.time() - T0 >= self.cap_s

    def result(self, env_steps: int) -> dict[str, Any]:
        hit = self.reached.get(str(self.target))
        return {
            "reached": hit is not None,
            "seconds": hit[0] if hit else self.cap_s,  # a miss counts as the cap, however early the peer stopped
            "stopped_s": time.time() - T0,
            "env_steps": hit[1] if hit else int(env_steps),
            "final": self.points[-1][2] if self.points else None,
            "thresholds": self.reached,
            "points": self.points[-400:],
        }


# ---------------------------------------------------------------- Stable-Baselines3 with rl-zoo's settings


def zoo_hyperparams(algo: str, env_id: str) -> dict[str, Any]:
    import rl_zoo3
    import yaml

    table = yaml.safe_load((Path(rl_zoo3.__file__).parent / "hyperparams" / f"{algo}.yml").read_text())
    return dict(table["atari" if "NoFrameskip" in env_id else env_id])


def _schedule(value: Any) -> Any:
    """rl-zoo's `lin_X`: X falling linearly to 0 over training."""
    if isinstance(value, str) and value.startswith("lin_"):
        start = float(value[4:])
        return lambda remaining: remaining * start
    return value


def run_sb3(task: str, seed: int, cap_s: float, threads: int) -> dict[str, Any]:
    import torch
    from stable_baselines3 import DQN, PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_atari_env, make_vec_env
    from stable_baselines3.common.evaluation import evaluate_policy
    from stable_baselines3.common.vec_env import VecFrameStack, VecNormalize

    torch.set_num_threads(threads)
    env_id, algo, metric, target, thresholds = TASKS[task]
    progress = Progress(target, thresholds, cap_s)
    h = zoo_hyperparams(algo, env_id)
    n_envs, steps = int(h.pop("n_envs", 1)), int(float(h.pop("n_timesteps")))
    policy, normalize, frame_stack = h.pop("policy"), h.pop("normalize", False), h.pop("frame_stack", None)
    h.pop("env_wrapper", None)
    if "policy_kwargs" in h:  # rl-zoo writes them as Python (dict(net_arch=[...])): its own, trusted file
        h["policy_kwargs"] = eval(h["policy_kwargs"], {"__builtins__": {}, "dict": dict, "nn": torch.nn})
    h = {k: _schedule(v) for k, v in h.items()}
    if "NoFrameskip" in env_id:
        import ale_py
        import gymnasium as gym

        gym.register_envs(ale_py)
        env = VecFrameStack(make_atari_env(env_id, n_envs=n_envs, seed=seed), frame_stack)
    else:
        env = make_vec_env(env_id, n_envs=n_envs, seed=seed)
    if normalize:
        env = VecNormalize(env, gamma=h.get("gamma", 0.99))
    model = (PPO if algo == "ppo" else DQN)(policy, env, seed=seed, verbose=0, device="cpu", **h)
    eval_env = make_vec_env(env_id, n_envs=1, seed=seed + 1000) if metric == "greedy_eval20" else None

    class Watch(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
            self.last_eval = 0

        def _on_step(self) -> bool:
            if metric == "train_mean100":
                buffer = self.model.ep_info_buffer  # the Monitor's last 100 episodes: the real game score
                value = sum(e["r"] for e in buffer) / len(buffer) if buffer else None
                return not progress.report(self.num_timesteps, value)
            if self.num_timesteps - self.last_eval >= 2000:  # greedy evaluation, 20 episodes
                self.last_eval = self.num_timesteps
                mean, _ = evaluate_policy(self.model, eval_env, n_eval_episodes=20, deterministic=True)
                return not progress.report(self.num_timesteps, mean)
            return not progress.report(self.num_timesteps, None)

    # rl-zoo's schedules (exploration, lin_ learning rates and clips) run over its n_timesteps: train that
    # long as published, then, short of the target with time left, on at the schedules' final values
    watch = Watch()
    model.learn(total_timesteps=steps, callback=watch)
    if not progress.done() and hold_schedules_at_their_end(model):
        model.learn(total_timesteps=10**9, callback=watch, reset_num_timesteps=False)
    return progress.result(model.num_timesteps)


def hold_schedules_at_their_end(model: Any) -> bool:
    """Freeze an SB3 model's schedules at their final values (progress remaining 0); False when its learning
    rate ends at 0 (rl-zoo's lin_ schedules): then more steps would teach it nothing."""
    final_lr = model.lr_schedule(0.0)
    if final_lr <= 0:
        return False
    model.lr_schedule = lambda _: final_lr
    for name in ("exploration_schedule", "clip_range", "clip_range_vf"):
        schedule = getattr(model, name, None)
        if callable(schedule):
            final = schedule(0.0)
            setattr(model, name, lambda _, final=final: final)
    return True


# ---------------------------------------------------------------- RLlib with its tuned examples


def rllib_config(task: str, seed: int, runners: int) -> Any:
    """rllib/tuned_examples/{ppo/cartpole_ppo.py, dqn/cartpole_dqn.py, ppo/atari_ppo.py, appo/pong_appo.py}, as
    published; Acrobot has no tuned example: RLlib's PPO defaults."""
    from ray.rllib.algorithms.dqn import DQNConfig
    from ray.rllib.algorithms.ppo import PPOConfig

    env_id, algo, metric, _, _ = TASKS[task]
    if task == "cartpole-ppo":
        config = (
            PPOConfig()
            .environment("CartPole-v1")
            .training(lr=0.0003, num_epochs=6, vf_loss_coeff=0.01)
            .rl_module(model_config={"fcnet_hiddens": [32], "fcnet_activation": "linear", "vf_share_layers": True})
        )
    elif task == "acrobot-ppo":
        config = PPOConfig().environment("Acrobot-v1")
    elif task == "cartpole-dqn":
        from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

        config = (
            DQNConfig()
            .environment("CartPole-v1")
            .training(
                lr=0.0005,
                train_batch_size_per_learner=32,
                replay_buffer_config={
                    "type": "PrioritizedEpisodeReplayBuffer",
                    "capacity": 50000,
                    "alpha": 0.6,
                    "beta": 0.4,
                },
                n_step=(2, 5),
                double_q=True,
                dueling=True,
                epsilon=[(0, 1.0), (10000, 0.02)],
            )
            .rl_module(
                model_config=DefaultModelConfig(
                    fcnet_hiddens=[256],
                    fcnet_activation="tanh",
                    fcnet_bias_initializer="zeros_",
                    head_fcnet_bias_initializer="zeros_",
                    head_fcnet_hiddens=[256],
                )
            )
            .evaluation(
                evaluation_interval=1,
                evaluation_duration=20,
                evaluation_duration_unit="episodes",
                evaluation_config={"explore": False},
                evaluation_num_env_runners=0,
            )
        )
    elif task == "pong-ppo":
        config = rllib_atari_ppo()
    else:
        config = rllib_pong_appo()
        runners = max(1, runners - 1)  # APPO's learner holds a CPU of its own: an env runner on every other core
    return config.env_runners(num_env_runners=runners).debugging(seed=seed)


def register_pong(dim: int | None = None) -> str:
    """ALE/Pong-v5 made like the old PongNoFrameskip-v4, with RLlib's Atari wrappers (frames stacked by a
    connector, as RLlib's tuned examples do)."""
    import gymnasium as gym
    from ray import tune
    from ray.rllib.env.wrappers.atari_wrappers import wrap_atari_for_new_api_stack

    def make(cfg: dict) -> Any:
        import ale_py

        gym.register_envs(ale_py)
        size = {} if dim is None else {"dim": dim}
        return wrap_atari_for_new_api_stack(gym.make("ALE/Pong-v5", **cfg), framestack=None, **size)

    tune.register_env("pong", make)
    return "pong"


PONG_ENV_CONFIG = {"frameskip": 1, "full_action_space": False, "repeat_action_probability": 0.0}
PONG_MODEL = {  # the network of both of RLlib's tuned Pong examples
    "vf_share_layers": True,
    "conv_filters": [[16, 4, 2], [32, 4, 2], [64, 4, 2], [128, 4, 2]],
    "conv_activation": "relu",
    "head_fcnet_hiddens": [256],
}


def stack_four_frames_on_runners(env: Any, spaces: Any = None, device: Any = None) -> Any:
    """RLlib's Pong examples stack 4 frames in connectors: on the env runners ..."""
    from ray.rllib.connectors.env_to_module.frame_stacking import FrameStackingEnvToModule

    return FrameStackingEnvToModule(num_frames=4)


def stack_four_frames_on_learner(obs_space: Any, act_space: Any) -> Any:
    """... and again on the learner."""
    from ray.rllib.connectors.learner.frame_stacking import FrameStackingLearner

    return FrameStackingLearner(num_frames=4)


def rllib_atari_ppo() -> Any:
    """rllib/tuned_examples/ppo/atari_ppo.py; its learning rate is 0.00015 x GPUs: 0.00015 here (one GPU's)."""
    from ray.rllib.algorithms.ppo import PPOConfig

    return (
        PPOConfig()
        .environment(register_pong(), env_config=PONG_ENV_CONFIG, clip_rewards=True)
        .env_runners(env_to_module_connector=stack_four_frames_on_runners)
        .training(
            learner_connector=stack_four_frames_on_learner,
            train_batch_size_per_learner=4000,
            minibatch_size=128,
            lambda_=0.95,
            kl_coeff=0.5,
            clip_param=0.1,
            vf_clip_param=10.0,
            entropy_coeff=0.01,
            num_epochs=10,
            lr=0.00015,
            grad_clip=100.0,
            grad_clip_by="global_norm",
        )
        .rl_module(model_config=PONG_MODEL)
    )


def rllib_pong_appo() -> Any:
    """rllib/tuned_examples/appo/pong_appo.py (64x64 frames, one learner: lr 0.0005)."""
    from ray.rllib.algorithms.appo import APPOConfig

    return (
        APPOConfig()
        .environment(register_pong(dim=64), env_config=PONG_ENV_CONFIG, clip_rewards=True)
        .env_runners(
            env_to_module_connector=stack_four_frames_on_runners,
            num_envs_per_env_runner=2,
        )
        # the example's 2 aggregator actors take a CPU each: beside an env runner on every core they never
        # start (Ray holds them pending and the run hangs), so aggregation on the learner (RLlib's default)
        .learners(num_aggregator_actors_per_learner=0)
        .training(
            learner_connector=stack_four_frames_on_learner,
            train_batch_size_per_learner=500,
            target_network_update_freq=2,
            lr=0.0005,
            vf_loss_coeff=1.0,
            entropy_coeff=[[0, 0.01], [3000000, 0.0]],
            broadcast_interval=5,
            circular_buffer_num_batches=4,
            circular_buffer_iterations_per_batch=2,
        )
        .rl_module(model_config=PONG_MODEL)
    )


def run_rllib(task: str, seed: int, cap_s: float, runners: int) -> dict[str, Any]:
    import ray

    _, _, metric, target, thresholds = TASKS[task]
    progress = Progress(target, thresholds, cap_s)
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    algo = rllib_config(task, seed, runners).build_algo()
    steps = 0
    while True:
        result = algo.train()
        steps = int(result.get("num_env_steps_sampled_lifetime", steps))
        if metric == "greedy_eval20":
            value = result.get("evaluation", {}).get("env_runners", {}).get("episode_return_mean")
        else:
            value = result.get("env_runners", {}).get("episode_return_mean")
        if progress.report(steps, value):
            break
    algo.stop()
    ray.shutdown()
    return progress.result(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", choices=["rllib", "sb3"], required=True)
    parser.add_argument("--task", choices=list(TASKS), required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cap-s", type=float, default=300.0)
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    run = run_rllib if args.system == "rllib" else run_sb3
    result = run(args.task, args.seed, args.cap_s, args.cores)
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
