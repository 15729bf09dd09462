"""Where the monitor's rows go: metrics.csv, metrics.jsonl, TensorBoard, and one console line."""

from __future__ import annotations

import contextlib
import csv
import json
import socket
import struct
import sys
import time
from pathlib import Path
from typing import BinaryIO, TextIO

import numpy as np
from tensorboardX.proto.event_pb2 import Event
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.record_writer import masked_crc32c
from tensorboardX.summary import histogram, scalar


class RowWriter:
    """metrics.csv, metrics.jsonl and TensorBoard: every key of every row in all three. A metric that
    first appears after the first row (train/ stats arrive with the first update) widens the CSV:
    the file is rewritten once with the new header, earlier rows empty in the new columns."""

    def __init__(self, run_dir: Path, tensorboard: bool):
        self.csv_path = run_dir / "metrics.csv"
        self._jsonl = open(run_dir / "metrics.jsonl", "a")  # noqa: SIM115  (open for the run; closed in close)
        self._csv_file: TextIO | None = None
        self._csv: csv.DictWriter | None = None
        self.columns: list[str] = _csv_columns(self.csv_path)  # a resumed run appends to its CSV
        self._tb = TensorBoardFile(run_dir / "tensorboard") if tensorboard else None

    def write(self, row: dict[str, float], lags: list[int]) -> None:
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        self._write_csv(row)
        if self._tb is not None:
            self._tb.write(row, lags)

    def _write_csv(self, row: dict[str, float]) -> None:
        new = [key for key in row if key not in self.columns]
        if new or self._csv is None or self._csv_file is None:
            self._csv_file, self._csv = self._reopen_csv(self.columns + new)
        self._csv.writerow(row)
        self._csv_file.flush()

    def _reopen_csv(self, columns: list[str]) -> tuple[TextIO, csv.DictWriter]:
        """Open the CSV for appending under `columns`, rewriting what it holds when they changed."""
        if self._csv_file is not None:
            self._csv_file.close()
        if columns != self.columns:
            rows = _csv_rows(self.csv_path)
            tmp = self.csv_path.with_suffix(".csv.tmp")
            with open(tmp, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=columns)
                writer.writeheader()
                writer.writerows(rows)
            tmp.replace(self.csv_path)
            self.columns = columns
        self._csv_file = None
        handle = open(self.csv_path, "a", newline="")  # noqa: SIM115  (open for the run)
        return handle, csv.DictWriter(handle, fieldnames=self.columns, extrasaction="ignore")

    def close(self) -> None:
        self._jsonl.close()
        if self._csv_file is not None:
            self._csv_file.close()
        if self._tb is not None:
            self._tb.close()


class TensorBoardFile:
    """TensorBoard's event file, one event per row, written and flushed by the caller's thread: a write
    that fails (a full disk) raises to the caller like the other files, and the next row starts a new
    file, since the failed one may end in a torn record. (tensorboardX's SummaryWriter writes from a
    thread that dies on such an error; the run then blocked on its full queue, for good.)"""

    def __init__(self, directory: Path):
        self.directory = directory
        self._file: BinaryIO | None = None
        self._files = 0

    def write(self, row: dict[str, float], lags: list[int]) -> None:
        values = [scalar(key, value).value[0] for key, value in row.items() if key != "env_steps" and value == value]
        if lags:
            edges = np.arange(max(lags) + 2) - 0.5  # one bucket per lag: they are whole numbers of versions
            values += histogram("balance/policy_lag", np.asarray(lags), edges).value
        event = Event(wall_time=time.time(), step=int(row["env_steps"]), summary=Summary(value=values))
        try:
            self._record(event)
        except OSError:
            self.close()
            raise

    def _record(self, event: Event) -> None:
        if self._file is None:
            self._file = self._open()
        self._file.write(_framed(event))
        self._file.flush()

    def _open(self) -> BinaryIO:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._files += 1
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{self._files}"
        handle = open(self.directory / name, "ab")  # noqa: SIM115  (open for the run; closed in close)
        try:
            handle.write(_framed(Event(wall_time=time.time(), file_version="brain.Event:2")))
        except OSError:
            with contextlib.suppress(OSError):
                handle.close()
            raise
        return handle

    def close(self) -> None:
        if self._file is not None:
            handle, self._file = self._file, None
            with contextlib.suppress(OSError):  # its buffer could not be written out: that file is given up
                handle.close()


def _framed(event: Event) -> bytes:
    """One TFRecord: length, its CRC, the serialized event, its CRC."""
    data = event.SerializeToString()
    header = struct.pack("Q", len(data))
    return header + struct.pack("I", masked_crc32c(header)) + data + struct.pack("I", masked_crc32c(data))


def _csv_columns(path: Path) -> list[str]:
    if not path.exists() or path.stat().st_size == 0:
        return []
    with open(path, newline="") as f:
        return next(csv.reader(f), [])


def _csv_rows(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


class ConsoleLine:
    """One progress line, rewritten in place on a terminal and appended otherwise."""

    def __init__(self, enabled: bool, show_ratio: bool = False):
        self.enabled = enabled
        self.show_ratio = show_ratio
        self.tty = sys.stdout.isatty()
        self._shown = False

    def show(self, row: dict[str, float]) -> None:
        if not self.enabled:
            return
        ret, evaluated = row["env/return_mean100"], row["eval/return_mean"]
        lag = row["balance/lag_mean"]
        line = (
            f"[{row['time_s']:7.1f}s] steps {int(row['env_steps']):>10,} "
            f"({row['perf/env_steps_per_s'] / 1000:6.1f}k/s) | return {ret:7.1f} "
            + (f"eval {evaluated:6.1f} " if evaluated == evaluated else "")
            + _win_rates(row)
            + f"ep {int(row['env/episodes']):>6} | v{int(row['balance/policy_version'])} "
            f"upd {row['perf/updates_per_s']:5.1f}/s{_per_learner_updates(row)} | lag {_fmt(row['balance/lag_min'])}/"
            f"{_fmt(lag, 1)}/{_fmt(row['balance/lag_max'])}{_bound(row)} "
            f"drop {int(row['balance/fragments_dropped'])} | "
            f"busy A {row['perf/actor_busy']:4.0%} L {row['perf/learner_busy']:4.0%}"
        )
        if row["balance/replay_ratio"] == row["balance/replay_ratio"] and self.show_ratio:
            line += f" | rr {row['balance/replay_ratio']:.1f}"
        line += _learning_signs(row)
        if self.tty:
            sys.stdout.write("\r" + line + "\033[K")
        else:
            sys.stdout.write(line + "\n")
        sys.stdout.flush()
        self._shown = True

    def finish(self) -> None:
        if self.enabled and self.tty and self._shown:
            sys.stdout.write("\n")
            sys.stdout.flush()


LEARNING_SIGNS = (
    ("train/entropy", "H", ".2f"),
    ("train/approx_kl", "kl", ".4f"),
    ("train/explained_variance", "ev", ".2f"),
    ("train/grad_norm", "|g|", ".3g"),
    ("train/lr", "lr", ".2e"),
    ("train/dead_units", "dead", ".0%"),
)


def _learning_signs(row: dict[str, float]) -> str:
    """' | H 1.78 kl 0.0021 ev 0.31 |g| 0.42 lr 2.50e-04': is the policy moving? (what the algorithm reports)"""
    parts = [f"{name} {row[key]:{spec}}" for key, name, spec in LEARNING_SIGNS if key in row and row[key] == row[key]]
    return " | " + " ".join(parts) if parts else ""


def _per_learner_updates(row: dict[str, float]) -> str:
    """' (9.8+10.1)': each learner's share of a group's updates/s (nothing for one learner)."""
    shares = [v for k, v in row.items() if k.startswith("perf/learner") and k.endswith("/updates_per_s")]
    return f" ({'+'.join(f'{v:.1f}' for v in shares)})" if len(shares) > 1 else ""


def _win_rates(row: dict[str, float]) -> str:
    """'win 45% eval 60% ' for envs that report wins, nothing otherwise."""
    train, evaluated = row["env/win_rate100"], row["eval/win_rate"]
    return (f"win {train:4.0%} " if train == train else "") + (
        f"eval win {evaluated:4.0%} " if evaluated == evaluated else ""
    )


def _bound(row: dict[str, float]) -> str:
    """' of 4 (2 cr)': the lag bound and the credits per actor now, where the learner said them."""
    bound, inflight = row.get("balance/lag_bound", float("nan")), row.get("balance/inflight", float("nan"))
    if bound != bound:
        return ""
    return f" of {bound:.0f}" + (f" ({inflight:.0f} cr)" if inflight == inflight else "")


def _fmt(x: float, digits: int = 0) -> str:
    return "-" if x != x else f"{x:.{digits}f}"
