"""`tianji sweep`: hyperparameter search over any config field, each trial an ordinary run.

    tianji sweep cartpole-ppo --trials 20 --parallel 2                    # the preset's bundled space
    tianji sweep my.yaml --space my.space.yaml --max-minutes 60
    tianji sweep cartpole-ppo --param algo.lr=loguniform:1e-4:3e-3 --param algo.epochs=int:2:8
    tianji sweep --resume sweeps/cartpole-ppo-20250101-120000 --trials 30  # after Ctrl-C or a crash

The parts: `space` (what is searched and its checks against the config), `objective` (what a
trial's run is worth, and in which direction), `trial` (one trial as a `tianji train` subprocess
whose metrics feed the pruner), `study` (the search loop on an Optuna study stored in the sweep
directory), `report` (table, sweep.csv, best.yaml, plots).
"""
