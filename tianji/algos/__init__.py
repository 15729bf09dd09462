"""The one registry of algorithms; the runtime, the config and the tools find algorithms only through it.

Each algorithm module defines its config, networks, policy and learner and one `SPEC`; adding an
algorithm is its module plus one line here.
"""

from __future__ import annotations

from tianji.algos import appo, dqn, impala, mappo, ppo, qmix
from tianji.algos.base import AlgoSpec

ALGOS: dict[str, AlgoSpec] = {
    spec.name: spec
    for spec in (
        ppo.SPEC,
        dqn.SPEC,
        impala.SPEC,
        appo.SPEC,
        qmix.SPEC,
        mappo.SPEC,
    )
}


def get_algo(name: str) -> AlgoSpec:
    try:
        return ALGOS[name]
    except KeyError:
        raise ValueError(f"algo.name: unknown algorithm {name!r}; known: {sorted(ALGOS)}") from None
