"""Tensors and arrays at the algorithms' floor: named arrays, batches onto the learner's device, weights
in and out of a module, a plain MLP, explained variance. Everything in `tianji.algos` may import this; it
imports nothing of TianJi's."""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import numpy as np
import torch

Arrays = dict[str, np.ndarray]


def resolve_device(device: str) -> torch.device:
    """'auto': CUDA when this machine has it, else the CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("learner.device is 'cuda' but torch sees no CUDA device here")
    return torch.device(device)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A batch for the learner's device: on CUDA through pinned host memory with a non-blocking copy.
    Pixels stay uint8 here (the network converts them)."""
    if array.flags.writeable:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
    else:  # a read-only view of a shared-memory slot, trained on in place and never written
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def explained_variance(predicted: torch.Tensor, target: torch.Tensor) -> float:
    """1 - Var(target - predicted) / Var(target): 1 for a perfect value function, 0 for a constant one,
    negative when worse than a constant (NaN when the targets do not vary)."""
    variance = target.float().var()
    if target.numel() < 2 or variance <= 0:
        return float("nan")
    return float(1.0 - (target.float() - predicted.float()).var() / variance)


def module_weights(module: torch.nn.Module) -> Arrays:
    return {k: v.detach().cpu().numpy().copy() for k, v in module.state_dict().items()}


def load_module_weights(module: torch.nn.Module, weights: Mapping[str, np.ndarray]) -> None:
    state = module.state_dict()
    missing = set(state) - set(weights)
    if missing:
        raise ValueError(f"weights lack parameters: {sorted(missing)}")
    with torch.no_grad():
        for name, tensor in state.items():
            src = torch.from_numpy(np.asarray(weights[name]))
            if src.shape != tensor.shape:
                raise ValueError(f"weight {name}: shape {tuple(src.shape)}, expected {tuple(tensor.shape)}")
            tensor.copy_(src)


def mlp(sizes: list[int], activation: type[torch.nn.Module] = torch.nn.Tanh) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(torch.nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(activation())
    return torch.nn.Sequential(*layers)
