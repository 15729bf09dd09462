"""The one registry of algorithms; the runtime finds algorithms only through it."""

from __future__ import annotations

from tianji.algos.base import AlgoSpec


def _ppo() -> AlgoSpec:
    from tianji.algos.ppo import PPOLearner, PPOPolicy, check_spaces

    return AlgoSpec("ppo", PPOPolicy, PPOLearner, check_spaces)


def _dqn() -> AlgoSpec:
    from tianji.algos.dqn import DQNLearner, DQNPolicy, check_spaces

    return AlgoSpec("dqn", DQNPolicy, DQNLearner, check_spaces)


def _impala() -> AlgoSpec:
    from tianji.algos.impala import IMPALALearner, IMPALAPolicy
    from tianji.algos.ppo import check_spaces

    return AlgoSpec("impala", IMPALAPolicy, IMPALALearner, check_spaces)


def _appo() -> AlgoSpec:
    from tianji.algos.appo import APPOLearner
    from tianji.algos.impala import IMPALAPolicy
    from tianji.algos.ppo import check_spaces

    return AlgoSpec("appo", IMPALAPolicy, APPOLearner, check_spaces)


def _qmix() -> AlgoSpec:
    from tianji.algos.qmix import QMIXLearner, QMIXPolicy, check_spaces

    return AlgoSpec("qmix", QMIXPolicy, QMIXLearner, check_spaces)


def _mappo() -> AlgoSpec:
    from tianji.algos.mappo import MAPPOLearner, MAPPOPolicy
    from tianji.algos.qmix import check_spaces

    return AlgoSpec("mappo", MAPPOPolicy, MAPPOLearner, check_spaces)


_FACTORIES = {"ppo": _ppo, "dqn": _dqn, "impala": _impala, "appo": _appo, "qmix": _qmix, "mappo": _mappo}


def get_algo(name: str) -> AlgoSpec:
    try:
        return _FACTORIES[name]()
    except KeyError:
        raise ValueError(f"algo.name: unknown algorithm {name!r}; known: {sorted(_FACTORIES)}") from None
