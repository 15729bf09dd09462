"""Soak: one long training run, sampling every role's resident memory, open file descriptors and the
run's shared-memory files each minute; reports growth after a warm-up.

    python benchmarks/soak.py [--minutes 30] [--warmup 5] [--preset cartpole-ppo] [--set key=value ...]
                              [--run-dir DIR] [--out benchmarks/results/soak-pong]
    python benchmarks/soak.py --judge benchmarks/results/soak-pong.json [--window 5]   # judge again, no run

Goals: resident memory of every role grows < --max-growth (5 %) between the end of the warm-up and the
end (medians of --window samples at each end: one sample swings with the allocator); open file
descriptors and /dev/shm usage do not grow. Role restarts are followed (roles.json). The run trains
with no target, so it lasts the whole soak; `--run-dir` keeps it (its learning curve is an ordinary
run's). `--out` writes the samples and the growth as JSON and a table as Markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from tianji.runtime.transport.shm import shm_root

from common import train_command


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def open_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def shm_usage(driver_pid: int) -> tuple[int, float]:
    files = list(shm_root().glob(f"tianji-*p{driver_pid}-*"))
    return len(files), sum(f.stat().st_size for f in files if f.exists()) / 2**20


def sample(run_dir: Path, driver_pid: int, minute: float) -> dict:
    roles = {"driver": driver_pid, **json.loads((run_dir / "roles.json").read_text())}
    files, shm_mb = shm_usage(driver_pid)
    return {
        "minute": round(minute, 2),
        "rss_mb": {n: rss_mb(p) for n, p in roles.items()},
        "fds": {n: open_fds(p) for n, p in roles.items()},
        "shm_files": files,
        "shm_mb": shm_mb,
    }


def window_median(samples: list[dict], key: str, name: str | None = None) -> float | None:
    values = [s[key] if name is None else s[key].get(name) for s in samples]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def growth(samples: list[dict], warmup: float, window: int = 5) -> dict:
    """From the first `window` samples after the warm-up to the last `window`, medians of each: a role's
    resident memory swings +-10 % from one minute to the next (the allocator takes and returns batches), a
    leak lifts the whole band."""
    after = [s for s in samples if s["minute"] >= warmup] or samples[-1:]
    first, last = after[:window], after[-window:]
    rss, fds = {}, {}
    for name in samples[-1]["rss_mb"]:
        before, now = window_median(first, "rss_mb", name), window_median(last, "rss_mb", name)
        if before and now:
            rss[name] = (now - before) / before
        before, now = window_median(first, "fds", name), window_median(last, "fds", name)
        if before is not None and now is not None:
            fds[name] = int(now - before)
    return {
        "from_minute": first[0]["minute"],
        "to_minute": last[-1]["minute"],
        "window_samples": window,
        "rss_growth": rss,
        "fd_growth": fds,
        "shm_files_growth": int(window_median(last, "shm_files") - window_median(first, "shm_files")),
        "shm_mb_growth": window_median(last, "shm_mb") - window_median(first, "shm_mb"),
    }


def soak(args: argparse.Namespace) -> tuple[list[dict], dict]:
    """Train with no target for `args.minutes`, sampling every role each `args.interval` seconds; the samples
    and the run's last metrics row."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(args.run_dir) if args.run_dir else Path(tmp) / "soak"
        stop = ["stop.target_return=null", f"stop.max_wall_time_s={args.minutes * 60 + 60}"]
        command = train_command(args.preset, run_dir, *stop, *args.overrides)
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        try:
            while not (run_dir / "roles.json").exists():
                time.sleep(0.2)
            start, samples = time.time(), []
            while (minute := (time.time() - start) / 60) <= args.minutes and process.poll() is None:
                samples.append(sample(run_dir, process.pid, minute))
                print_sample(samples[-1])
                time.sleep(args.interval)
            return samples, last_metrics_row(run_dir)
        finally:
            process.terminate()
            process.wait(60)


def print_sample(s: dict) -> None:
    print(
        f"[{s['minute']:5.1f} min] rss MB "
        + " ".join(f"{n} {v:.0f}" for n, v in s["rss_mb"].items() if v)
        + " | fds "
        + " ".join(f"{n} {v}" for n, v in s["fds"].items() if v is not None)
        + f" | shm {s['shm_files']} files {s['shm_mb']:.1f} MB",
        flush=True,
    )


def last_metrics_row(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--warmup", type=float, default=5.0, help="minutes before growth is counted")
    parser.add_argument("--interval", type=float, default=60.0, help="seconds between samples")
    parser.add_argument("--window", type=int, default=5, help="growth compares medians of this many samples")
    parser.add_argument("--preset", default="cartpole-ppo")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--out", help="write the samples and the growth: OUT.json and OUT.md")
    parser.add_argument("--run-dir", help="keep the run here (default: a temporary folder)")
    parser.add_argument("--max-growth", type=float, default=0.05, help="goal: each role's RSS grows less than this")
    parser.add_argument("--judge", help="no run: judge the samples of an earlier soak's OUT.json again")
    args = parser.parse_args()
    if args.judge:
        saved = json.loads(Path(args.judge).read_text())
        samples = saved["samples"]
        summary = saved.get("last_row") or last_metrics_row(Path(args.run_dir))
        args.preset, args.minutes, args.overrides = saved["preset"], saved["minutes"], saved["overrides"]
    else:
        samples, summary = soak(args)
    result = growth(samples, args.warmup, args.window)
    print(
        f"\ngrowth from minute {result['from_minute']:.1f} to {result['to_minute']:.1f}, medians of "
        f"{args.window} samples (env steps {summary['env_steps']:,}, policy version "
        f"{summary['balance/policy_version']}):"
    )
    for name, g in result["rss_growth"].items():
        print(f"  {name:<10} rss {g:+7.1%}  fds {result['fd_growth'].get(name, 0):+d}")
    print(f"  shm files {result['shm_files_growth']:+d}, shm MB {result['shm_mb_growth']:+.1f}")
    worst = max(result["rss_growth"].values(), default=0.0)
    ok = worst < args.max_growth and not any(result["fd_growth"].values()) and result["shm_files_growth"] <= 0
    print(f"goal (rss < +{args.max_growth:.0%}, no fd or shm growth): {'met' if ok else 'NOT met'}")
    if args.out:
        write_results(Path(args.out), args, samples, result, summary, ok)


def write_results(
    out: Path, args: argparse.Namespace, samples: list[dict], result: dict, last_row: dict, ok: bool
) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(
        json.dumps(
            {
                "preset": args.preset,
                "minutes": args.minutes,
                "overrides": args.overrides,
                "samples": samples,
                "last_row": last_row,
                "growth": result,
                "goal_met": ok,
            },
            indent=1,
        )
    )
    roles = list(samples[-1]["rss_mb"])
    lines = [
        f"# Soak: `{args.preset}` for {args.minutes:.0f} minutes ({time.strftime('%Y-%m-%d')})",
        "",
        f"Env steps {last_row['env_steps']:,}, policy version {last_row['balance/policy_version']}. "
        f"Growth from minute {result['from_minute']:.1f} to {result['to_minute']:.1f} "
        f"(medians of {result['window_samples']} samples at each end): "
        + ", ".join(f"{n} RSS {g:+.1%}" for n, g in result["rss_growth"].items())
        + f"; file descriptors {result['fd_growth']}; shared memory files {result['shm_files_growth']:+d}. "
        f"Goal (RSS < +{args.max_growth:.0%}, no fd or shm growth): {'met' if ok else 'NOT met'}.",
        "",
        "| minute | "
        + " | ".join(f"{n} RSS MB" for n in roles)
        + " | "
        + " | ".join(f"{n} fds" for n in roles)
        + " | shm files | shm MB |",
        "|" + "---|" * (2 * len(roles) + 3),
    ]
    for s in samples:
        lines.append(
            f"| {s['minute']:.1f} | "
            + " | ".join(f"{s['rss_mb'].get(n) or 0:.0f}" for n in roles)
            + " | "
            + " | ".join(str(s["fds"].get(n)) for n in roles)
            + f" | {s['shm_files']} | {s['shm_mb']:.1f} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
