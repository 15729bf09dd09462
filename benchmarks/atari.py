"""One Atari preset on many games, next to published scores: the table CleanRL and rl-baselines3-zoo users
look for.

    python benchmarks/atari.py [--games BeamRider Qbert SpaceInvaders Seaquest Enduro Pong] [--seeds 2]
                               [--first-seed 0] [--minutes 60] [--preset atari-appo] [--set key=value ...]
                               [--run-root runs/atari] [--from-runs DIR ...] [--replace]

Each run is `tianji train atari-appo --set env.id=ALE/GAME-v5 --set seed=S` as a fresh command, one at a
time, capped at --minutes (the machine's cores are the run's alone: run nothing else beside it). The game's
100-episode mean score (unclipped game score, whole games) is read from the run's metrics at 15, 30 and 60
minutes from the command's start. Runs are merged by (game, seed) into benchmarks/results/atari.json, so
the table grows over several sittings (an hour a run); --from-runs adds finished run directories without
training again. It writes benchmarks/results/atari.{md,json,png}: per game the scores at each mark, env
steps, env steps/s, CleanRL's published PPO score at 10M env steps, a random and a human player's scores and
the human-normalised score, and a figure with one panel per game (score against minutes).

The published scores (REFERENCES) are quoted with their sources; the goal checked is 50 % of CleanRL's
10M-step score within 60 minutes on this machine.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from pathlib import Path

import yaml

from common import (
    Sittings,
    curve,
    finished,
    machine,
    machines_of,
    metric_rows,
    run_tianji,
    steps_and_rate,
    summary_of,
    update_page_tables,
    value_at,
)

RESULTS = Path(__file__).parent / "results"
GAMES = ["BeamRider", "Qbert", "SpaceInvaders", "Seaquest", "Enduro", "Pong"]
MARKS_MIN = (15, 30, 60)
SCORE = "env/return_mean100"  # the 100-episode mean game score
GOAL_SHARE = 0.5  # of CleanRL's 10M-step score, within 60 minutes

# CleanRL's PPO at 10M env steps (40M frames), the mean over 3 seeds of each seed's last 100 training
# episodes (whole games, unclipped): docs/benchmark/ppo_atari_envpool_xla_jax.md in vwxyzjn/cleanrl
# (docs.cleanrl.dev/rl-algorithms/ppo/, variant ppo_atari_envpool_xla_jax, no sticky actions).
CLEANRL_PPO_10M = {
    "BeamRider": 2478.44,
    "Qbert": 17246.27,
    "SpaceInvaders": 1188.82,
    "Seaquest": 1240.30,
    "Enduro": 1297.23,
    "Pong": 20.39,
    "Breakout": 430.09,
}
CLEANRL_SOURCE = (
    "CleanRL: ppo_atari_envpool_xla_jax, 10M env steps, 3 seeds (docs/benchmark/ppo_atari_envpool_xla_jax.md)"
)
# (random, human) game scores for the human-normalised score (score - random) / (human - random), as in
# google-deepmind/dqn_zoo, dqn_zoo/atari_data.py (the table of Agent57 / R2D2; openrlbenchmark's hns.py too).
RANDOM_HUMAN = {
    "BeamRider": (363.9, 16926.5),
    "Qbert": (163.9, 13455.0),
    "SpaceInvaders": (148.0, 1668.7),
    "Seaquest": (68.4, 42054.7),
    "Enduro": (0.0, 860.5),
    "Pong": (-20.7, 14.6),
    "Breakout": (1.7, 30.5),
}


def game_of(env_id: str) -> str:
    """'ALE/SpaceInvaders-v5' -> 'SpaceInvaders'."""
    return env_id.removeprefix("ALE/").split("-")[0]


def run_row(run_dir: Path, minutes: float) -> dict:
    """One finished run, read from its directory: its game and seed, scores at each mark, steps and rate."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    rows = [r for r in metric_rows(run_dir) if r["time_s"] <= minutes * 60 + 1]
    last = rows[-1]
    return {
        "game": game_of(config["env"]["id"]),
        "seed": config["seed"],
        "preset": config["name"],
        "scores": {str(m): value_at(rows, SCORE, m * 60) for m in MARKS_MIN if m <= minutes},
        "env_steps": last["env_steps"],
        "wall_time_s": last["time_s"],
        "env_steps_per_s": last["env_steps"] / last["time_s"],
        "episodes": last.get("env/episodes"),
        "curve": curve(rows, SCORE),
        "stop_reason": summary_of(run_dir).get("stop_reason"),
        "machine": machine(),
        "date": datetime.date.today().isoformat(),
    }


def share_of_cleanrl(game: str, score: float | None) -> float | None:
    reference = CLEANRL_PPO_10M.get(game)
    return None if score is None or reference is None else score / reference


def human_normalised(game: str, score: float | None) -> float | None:
    if score is None or game not in RANDOM_HUMAN:
        return None
    random, human = RANDOM_HUMAN[game]
    return (score - random) / (human - random)


def median_score(runs: list[dict], mark: int) -> float | None:
    scores = [r["scores"].get(str(mark)) for r in runs]
    scores = [s for s in scores if s is not None]
    return statistics.median(scores) if scores else None


def _fmt(value: float | None, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def markdown(runs: list[dict]) -> str:
    by_game: dict[str, list[dict]] = {}
    for run in runs:
        by_game.setdefault(run["game"], []).append(run)
    lines = [
        "| game | seeds | score at 15 / 30 / 60 min (median; each seed) | env steps in 60 min | env steps/s | "
        "CleanRL PPO, 10M env steps | share at 60 min | random | human | human-normalised at 60 min | "
        f"goal: {GOAL_SHARE:.0%} of CleanRL in 60 min |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for game in sorted(by_game, key=lambda g: (GAMES.index(g) if g in GAMES else len(GAMES), g)):
        seeds = sorted(by_game[game], key=lambda r: r["seed"])
        marks = " / ".join(_fmt(median_score(seeds, m)) for m in MARKS_MIN)
        each = "; ".join(" / ".join(_fmt(r["scores"].get(str(m))) for m in MARKS_MIN) for r in seeds)
        final = median_score(seeds, MARKS_MIN[-1])
        share = share_of_cleanrl(game, final)
        random, human = RANDOM_HUMAN.get(game, (None, None))
        goal = "-" if share is None else ("met" if share >= GOAL_SHARE else "missed")
        lines.append(
            f"| {game} | {len(seeds)} ({', '.join(str(r['seed']) for r in seeds)}) | {marks} ({each}) | "
            f"{steps_and_rate(seeds)} | {_fmt(CLEANRL_PPO_10M.get(game))} | "
            f"{_fmt(share, '.0%')} | {_fmt(random, ',.1f')} | {_fmt(human, ',.1f')} | "
            f"{_fmt(human_normalised(game, final), '.2f')} | {goal} |"
        )
    lines += [
        "",
        f"Scores: 100-episode mean game score (unclipped, whole games). {CLEANRL_SOURCE}.",
        f"Random and human: dqn_zoo's atari_data.py. Machine: {machines_of(runs)}.",
    ]
    return "\n".join(lines) + "\n"


def figure(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    games = sorted({r["game"] for r in runs}, key=lambda g: (GAMES.index(g) if g in GAMES else len(GAMES), g))
    columns = min(3, len(games))
    rows = (len(games) + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.2 * rows), squeeze=False)
    for ax, game in zip(axes.flat, games, strict=False):
        for run in sorted((r for r in runs if r["game"] == game), key=lambda r: r["seed"]):
            minutes, scores = zip(*run["curve"], strict=True) if run["curve"] else ((), ())
            ax.plot(minutes, scores, label=f"seed {run['seed']}")
        if game in CLEANRL_PPO_10M:
            ax.axhline(CLEANRL_PPO_10M[game], color="grey", linestyle="--", label="CleanRL PPO, 10M steps")
            ax.axhline(GOAL_SHARE * CLEANRL_PPO_10M[game], color="grey", linestyle=":", label="goal")
        ax.set_title(game)
        ax.set_xlabel("minutes (2 cores)")
        ax.set_ylabel("100-episode mean score")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(games) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--games", nargs="*", default=GAMES[:-1], help="games by ale-py name (default: the five)")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, default=60.0, help="each run's cap")
    parser.add_argument("--preset", default="atari-appo")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="an override for every run")
    parser.add_argument("--run-root", default="runs/atari", help="where the run directories are kept")
    parser.add_argument("--from-runs", nargs="+", default=[], metavar="RUN_DIR", help="finished runs to add")
    parser.add_argument("--out", default=str(RESULTS / "atari"), help="results path without suffix")
    parser.add_argument("--replace", action="store_true", help="drop the earlier runs in the results")
    args = parser.parse_args()
    out = Path(args.out)
    sittings = Sittings(out, "game", args.replace)
    for run_dir in map(Path, args.from_runs):
        sittings.add(run_row(run_dir, args.minutes))
    for game in [] if args.from_runs else args.games:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            run_dir = Path(args.run_root) / f"{game}-seed{seed}"
            settings = [f"env.id=ALE/{game}-v5", f"stop.max_wall_time_s={args.minutes * 60}", *args.overrides]
            if not finished(run_dir):  # a sitting cut short goes on with the runs it has not made
                run_tianji(args.preset, run_dir, seed, settings)
            row = run_row(run_dir, args.minutes)
            sittings.add(row)
            sittings.save(markdown)
            print(f"{game} seed {seed}: {row['scores']}, {row['env_steps']:,} env steps", flush=True)
    table = sittings.save(markdown)
    print(table)
    if out == RESULTS / "atari":  # the project's own table, not a scratch one
        update_page_tables("atari table", table)
    figure(sittings.ordered(), out.with_suffix(".png"))


if __name__ == "__main__":
    main()
