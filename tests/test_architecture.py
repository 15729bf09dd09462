"""The house plan holds: folders are layers, a module imports only from its own layer or those below,
no import circles, and no import hidden inside a function (except the CLI's, which keep
`tianji --help` fast)."""

from __future__ import annotations

import ast
from pathlib import Path

import tianji

ROOT = Path(tianji.__file__).parent
LAYERS = [  # bottom first: a module may import its own layer and those below
    ("tianji", "tianji.sections"),
    ("tianji.algos", "tianji.envs"),
    ("tianji.config",),
    # bytes between processes; process life; the balance rules; learner-group collectives
    ("tianji.runtime.transport", "tianji.runtime.process", "tianji.runtime.balance", "tianji.runtime.sync"),
    ("tianji.runtime.shared",),  # what roles and the driver both speak: run context, events, checkpoint files
    ("tianji.runtime.roles", "tianji.runtime.driver"),  # side by side: neither imports the other (below)
    ("tianji.runtime.launchers",),
    ("tianji.tools",),
    ("tianji.cli", "tianji.__main__"),
]
APART = [  # rooms of one layer that must not import each other
    ("tianji.runtime.roles", "tianji.runtime.driver"),
    ("tianji.runtime.transport", "tianji.runtime.sync"),
]
LAZY_IMPORTS_ALLOWED = {"tianji.cli"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    best = max(
        (prefix for layer in LAYERS for prefix in layer if module == prefix or module.startswith(prefix + ".")), key=len
    )
    return next(i for i, layer in enumerate(LAYERS) if best in layer)


def tianji_imports(tree: ast.Module) -> list[tuple[str, bool]]:
    """(imported tianji module, inside a function?) for every import in the file."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom) and child.module and child.module.split(".")[0] == "tianji":
                for alias in child.names:  # `from tianji.algos import ppo` imports the module tianji.algos.ppo
                    sub = f"{child.module}.{alias.name}"
                    found.append(
                        (
                            sub if (ROOT.parent / sub.replace(".", "/")).with_suffix(".py").exists() else child.module,
                            nested,
                        )
                    )
            elif isinstance(child, ast.Import):
                found.extend((a.name, nested) for a in child.names if a.name.split(".")[0] == "tianji")
            visit(child, nested)

    visit(tree, False)
    return found


def import_graph() -> dict[str, list[tuple[str, bool]]]:
    return {module_name(p): tianji_imports(ast.parse(p.read_text())) for p in ROOT.rglob("*.py")}


def test_no_module_imports_a_layer_above_its_own():
    upward = [f"{m} -> {i}" for m, imports in import_graph().items() for i, _ in imports if layer_of(i) > layer_of(m)]
    assert not upward, upward


def in_room(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def test_rooms_of_one_layer_that_must_stay_apart_do():
    """Roles do not depend on their supervisor (the driver), nor the driver on the roles' code: what they
    share lives below both, in tianji.runtime.shared. Transport carries bytes and knows no learner group."""
    crossing = [
        f"{m} -> {i}"
        for m, imports in import_graph().items()
        for i, _ in imports
        for a, b in APART
        if (in_room(m, a) and in_room(i, b)) or (in_room(m, b) and in_room(i, a))
    ]
    assert not crossing, crossing


def test_no_import_hides_inside_a_function():
    hidden = [
        f"{m} -> {i}"
        for m, imports in import_graph().items()
        for i, lazy in imports
        if lazy and m not in LAZY_IMPORTS_ALLOWED
    ]
    assert not hidden, hidden


def test_no_import_circles():
    graph = {m: {i for i, _ in imports if i != m} for m, imports in import_graph().items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def cycle_from(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for target in graph.get(module, ()):
            if state.get(target) == 1:
                return path + [module, target]
            if target not in state and (found := cycle_from(target, path + [module])):
                return found
        state[module] = 2
        return None

    for module in graph:
        if module not in state:
            assert (found := cycle_from(module, [])) is None, " -> ".join(found)


def test_every_algorithm_is_one_registry_entry_whose_config_is_the_algo_section():
    from tianji.algos import ALGOS
    from tianji.config import build_config

    for name, spec in ALGOS.items():
        assert spec.name == name and spec.config.__module__ == spec.make_learner.__module__, name  # one place
        assert type(build_config({"algo": {"name": name}}).algo) is spec.config


def test_the_type_checkers_algo_union_is_the_registry():
    """tianji.config spells the `algo` union out for mypy; it must name every registered config, no more."""
    import re

    from tianji.algos import ALGOS

    source = (Path(__file__).parents[1] / "tianji" / "config.py").read_text()
    spelled = re.search(r"    AlgoConfig = ([A-Za-z| ]+)\n", source).group(1).split(" | ")
    assert sorted(spelled) == sorted(spec.config.__name__ for spec in ALGOS.values())


def test_every_algorithm_reads_its_policy_out_of_its_own_checkpoint():
    import gymnasium as gym
    import numpy as np

    from tianji.algos import ALGOS
    from tianji.config import build_config

    single = (gym.spaces.Box(-1, 1, (4,), np.float32), gym.spaces.Discrete(2))
    team = (
        gym.spaces.Dict(
            {
                "obs": gym.spaces.Box(-1, 1, (3, 5), np.float32),
                "state": gym.spaces.Box(-1, 1, (7,), np.float32),
                "avail_actions": gym.spaces.Box(0, 1, (3, 4), np.int8),
            }
        ),
        gym.spaces.MultiDiscrete([4] * 3),
    )
    for name, spec in ALGOS.items():
        obs_space, act_space = team if name in ("qmix", "mappo") else single
        spec.check_spaces(obs_space, act_space)
        learner = spec.make_learner(build_config({"algo": {"name": name}}).algo, obs_space, act_space, device="cpu")
        read, published = spec.policy_weights(learner.state_dict()), learner.weights()
        assert read.keys() == published.keys(), name
        assert all(np.array_equal(read[k], published[k]) for k in read), name


ALGOS_FLOORS = [  # inside tianji.algos, bottom first: shared parts, the interfaces, the algorithms, the registry
    ("tianji.algos.common",),
    ("tianji.algos.base",),
    tuple(f"tianji.algos.{name}" for name in ("ppo", "appo", "impala", "mappo", "dqn", "qmix")),
    ("tianji.algos",),
]


def floor_of(module: str) -> int | None:
    """The module's floor inside tianji.algos (None outside it), by its longest matching prefix."""
    matches = [(len(prefix), i) for i, floor in enumerate(ALGOS_FLOORS) for prefix in floor if in_room(module, prefix)]
    return max(matches)[1] if matches else None


def test_no_algorithm_module_imports_another():
    """Each algorithm is its own module over what they share (tianji.algos.common: the correction, the
    surrogate, V-trace batches); one algorithm never builds on another's module."""
    algorithms = set(ALGOS_FLOORS[2])
    crossing = [
        f"{m} -> {i}" for m, imports in import_graph().items() if m in algorithms for i, _ in imports if i in algorithms
    ]
    assert not crossing, crossing


def test_nothing_in_algos_imports_a_floor_above_its_own():
    graph = import_graph()
    upward = [
        f"{m} -> {i}"
        for m, imports in graph.items()
        for i, _ in imports
        if floor_of(m) is not None and floor_of(i) is not None and floor_of(i) > floor_of(m)
    ]
    assert not upward, upward
