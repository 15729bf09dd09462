"""What a user reads to see whether learning works: the diagnostic metrics of every policy-gradient
algorithm in a short run's CSV, a CSV that widens when metrics appear late, and `tianji plot`."""

from __future__ import annotations

import csv
import json
import math
import resource
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from tensorboardX.proto.event_pb2 import Event

from tianji.config import load_config
from tianji.runtime.driver.writers import ConsoleLine, RowWriter
from tianji.tools.train import train

EVERY_POLICY_GRADIENT = {"train/entropy", "train/approx_kl", "train/explained_variance", "train/grad_norm", "train/lr"}
SPREAD = "pettingzoo:mpe2.simple_spread_v3"


def csv_columns(run_dir: Path) -> list[str]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return next(csv.reader(f))


def jsonl_keys(run_dir: Path) -> set[str]:
    return {key for line in open(run_dir / "metrics.jsonl") for key in json.loads(line)}


RANGES = {  # what each diagnostic can be: a value outside means it measures something else
    "train/entropy": (0.0, 10.0),
    "train/approx_kl": (-1e-6, 5.0),
    "train/clip_frac": (0.0, 1.0),
    "train/explained_variance": (-1e3, 1.0),
    "train/grad_norm": (0.0, 1e6),
    "train/lr": (1e-12, 1.0),
    "train/rho_mean": (1e-6, 1e3),
    "train/rho_ess": (0.0, 1.0 + 1e-6),
    "train/rho_clipped": (0.0, 1.0),
    "train/dead_units": (0.0, 1.0),
}


@pytest.mark.parametrize(
    "preset, overrides, specific",
    [
        (
            "cartpole-ppo",
            ["algo.epochs=1", "topology.envs_per_actor=4", "topology.fragment_length=16"],
            {"train/clip_frac", "train/rho_ess", "train/behaviour_kl"},  # on the first minibatch step
        ),
        (
            "cartpole-ppo",
            ["algo.stale_correction=true", "algo.epochs=1", "topology.envs_per_actor=4", "topology.fragment_length=16"],
            {"train/clip_frac", "train/rho_mean", "train/rho_clipped", "train/rho_ess"},
        ),
        (
            "cartpole-impala",
            ["topology.actors=1", "topology.envs_per_actor=4", "topology.fragment_length=16"],
            {"train/rho_mean", "train/rho_clipped", "train/rho_ess"},
        ),
        (
            "cartpole-impala",
            ["algo.name=appo", "topology.actors=1", "topology.envs_per_actor=4", "topology.fragment_length=16"],
            {"train/clip_frac", "train/rho_mean", "train/rho_clipped", "train/rho_ess"},
        ),
        (
            "mpe-spread-mappo",
            [
                f"env.id={SPREAD}",
                "algo.epochs=1",
                "topology.actors=1",
                "topology.envs_per_actor=4",
                "topology.fragment_length=25",
            ],
            {"train/clip_frac", "train/rho_ess", "train/behaviour_kl"},
        ),
        (
            "catch-impala",
            ["topology.actors=1", "topology.envs_per_actor=4", "topology.fragment_length=16"],
            {"train/rho_mean", "train/dead_units"},
        ),
    ],
)
def test_policy_gradient_diagnostics_reach_the_csv(preset, overrides, specific, tmp_path):
    cfg = load_config(
        preset,
        [
            *overrides,
            "stop.target_return=null",
            "stop.max_env_steps=3000",
            "logging.console=false",
            "logging.interval_s=0.1",
            "eval.interval_s=null",
        ],
    )
    run_dir, _ = train(cfg, "inline", run_dir=str(tmp_path / "run"))
    columns = csv_columns(run_dir)
    assert EVERY_POLICY_GRADIENT | specific <= set(columns)
    assert jsonl_keys(run_dir) <= set(columns), "the CSV carries every metric the JSONL carries"
    rows = list(csv.DictReader((run_dir / "metrics.csv").read_text().splitlines()))
    for metric in EVERY_POLICY_GRADIENT | specific:  # numbers, in the range they can take, not only a column
        values = [float(row[metric]) for row in rows if row.get(metric) not in (None, "", "nan")]
        assert values and all(math.isfinite(v) for v in values), (metric, values[:5])
        low, high = RANGES.get(metric, (-math.inf, math.inf))
        assert all(low <= v <= high for v in values), (metric, values[:5])


def test_csv_widens_when_a_metric_first_appears_late(tmp_path):
    writer = RowWriter(tmp_path, tensorboard=False)
    writer.write({"time_s": 1.0, "env_steps": 10}, [])
    writer.write({"time_s": 2.0, "env_steps": 20, "train/entropy": 1.5}, [])
    writer.write({"time_s": 3.0, "env_steps": 30, "train/entropy": 1.4, "train/lr": 0.1}, [])
    writer.close()
    rows = list(csv.DictReader((tmp_path / "metrics.csv").read_text().splitlines()))
    assert list(rows[0]) == ["time_s", "env_steps", "train/entropy", "train/lr"]
    assert [row["train/entropy"] for row in rows] == ["", "1.5", "1.4"]
    assert rows[2]["train/lr"] == "0.1"
    resumed = RowWriter(tmp_path, tensorboard=False)  # a resumed run appends under the same header
    resumed.write({"time_s": 4.0, "env_steps": 40, "train/entropy": 1.3, "train/lr": 0.05}, [])
    resumed.close()
    rows = list(csv.DictReader((tmp_path / "metrics.csv").read_text().splitlines()))
    assert len(rows) == 4 and rows[3]["train/lr"] == "0.05"


def tensorboard_steps(directory: Path) -> list[tuple[int, set[str]]]:
    """(step, tags) of every event with a summary in the event files, read record by record."""
    found = []
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("Q", data[at : at + 8])
            event = Event.FromString(data[at + 12 : at + 12 + length])
            at += 16 + length
            if event.HasField("summary"):
                found.append((event.step, {value.tag for value in event.summary.value}))
    return found


def test_tensorboard_rows_survive_a_full_disk_and_the_run_never_blocks_on_them(tmp_path):
    """A row that cannot be written raises to the caller (which counts it) and the next one is written to
    a new event file; nothing waits on a writer thread that died (tensorboardX's did, and the run hung)."""
    writer = RowWriter(tmp_path, tensorboard=True)
    row = {"time_s": 1.0, "env_steps": 10, "train/entropy": 1.5, "eval/return_mean": float("nan")}
    writer.write(row, [1, 2])
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    failures = []

    def full_disk_rows():
        for step in (20, 30, 40):  # more rows than tensorboardX's queue holds would block it
            try:
                writer.write({**row, "env_steps": step}, [])
            except OSError as exc:
                failures.append(exc)

    resource.setrlimit(resource.RLIMIT_FSIZE, (1, hard))  # every file is past 1 byte: EFBIG, as on a full disk
    try:
        thread = threading.Thread(target=full_disk_rows, daemon=True)
        thread.start()
        thread.join(10)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert not thread.is_alive(), "a row blocked on a full disk"
    assert len(failures) == 3
    writer.write({**row, "env_steps": 50}, [3])
    writer.close()
    steps = tensorboard_steps(tmp_path / "tensorboard")
    assert [step for step, _ in steps] == [10, 50]
    assert steps[0][1] == {"time_s", "train/entropy", "balance/policy_lag"}, "NaN left out, lags as a histogram"


def fake_run(run_dir: Path, slope: float) -> Path:
    run_dir.mkdir(parents=True)
    writer = RowWriter(run_dir, tensorboard=False)
    for i in range(20):
        writer.write(
            {
                "time_s": float(i),
                "env_steps": 1000 * i,
                "env/return_mean100": -21 + slope * i,
                "eval/return_mean": float("nan"),
            },
            [],
        )
    writer.close()
    return run_dir


def test_plot_overlays_two_runs_in_one_png(tmp_path):
    pytest.importorskip("matplotlib")
    from tianji.tools.plot import overlay

    runs = [fake_run(tmp_path / "adam", 0.5), fake_run(tmp_path / "rmsprop", 1.0)]
    figure = overlay(runs)
    by_time, by_steps = figure.axes
    assert [line.get_label() for line in by_time.lines] == ["adam", "rmsprop"]
    assert len(by_steps.lines) == 2
    out = tmp_path / "compare.png"
    done = subprocess.run(
        [sys.executable, "-m", "tianji", "plot", *map(str, runs), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def console_row(**changes: float) -> dict[str, float]:
    nan = float("nan")
    row = {
        "time_s": 12.5,
        "env_steps": 123456,
        "perf/env_steps_per_s": 9876.0,
        "env/return_mean100": 201.5,
        "eval/return_mean": 480.0,
        "env/win_rate100": nan,
        "eval/win_rate": nan,
        "env/episodes": 640,
        "balance/policy_version": 37,
        "perf/updates_per_s": 9.8,
        "balance/lag_min": 0,
        "balance/lag_mean": 1.25,
        "balance/lag_max": 3,
        "balance/fragments_dropped": 2,
        "perf/actor_busy": 0.95,
        "perf/learner_busy": 0.5,
        "balance/replay_ratio": nan,
        "train/entropy": 0.61,
        "train/approx_kl": 0.0021,
        "train/grad_norm": nan,
    }
    return row | changes


def test_the_console_line_shows_progress_balance_and_the_learning_signs(capsys, monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    console = ConsoleLine(enabled=True, show_ratio=True)
    console.show(console_row())
    console.show(console_row(**{"env/win_rate100": 0.5, "eval/win_rate": 0.75, "balance/replay_ratio": 4.0}))
    console.show(
        console_row(
            **{"perf/learner0/updates_per_s": 4.9, "perf/learner1/updates_per_s": 5.1, "balance/lag_bound": 6.0}
            | {"balance/inflight": 4.0}
        )
    )
    console.finish()
    first, second, third = capsys.readouterr().out.splitlines()
    assert "steps    123,456 (   9.9k/s) | return   201.5 eval  480.0 ep    640 | v37" in first
    assert "lag 0/1.2/3 drop 2 | busy A  95% L  50% | H 0.61 kl 0.0021" in first
    assert "win" not in first and "rr" not in first and "|g|" not in first  # nothing shown that was not measured
    assert "win  50% eval win  75% " in second and second.split(" | ")[-2] == "rr 4.0"
    assert "upd   9.8/s (4.9+5.1)" in third and "lag 0/1.2/3 of 6 (4 cr) drop 2" in third


def test_a_disabled_console_prints_nothing(capsys):
    console = ConsoleLine(enabled=False)
    console.show(console_row())
    console.finish()
    assert capsys.readouterr().out == ""


def test_on_a_terminal_the_console_line_is_rewritten_in_place(capsys, monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    console = ConsoleLine(enabled=True)
    console.show(console_row())
    console.show(console_row(time_s=13.0))
    console.finish()
    out = capsys.readouterr().out
    assert out.count("\r") == 2 and out.count("\033[K") == 2 and out.endswith("\n") and out.count("\n") == 1
