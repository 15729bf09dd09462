"""Networks chosen by observation: the Nature CNN trunk for images, MLPs for vectors.

Observations reach the network as they came from the env (uint8 pixels stay uint8 through the
actor, shared memory and the learner's batch); they become floats only here, in the first layer.

    net = PolicyValueNet(obs_space, act_space, hidden=[64, 64], model="auto", init="orthogonal")  # PPO, IMPALA
    trunk, width = make_trunk(obs_space, hidden, model, activation)                              # DQN

Models: `mlp`; `cnn`, the Nature CNN (Mnih et al., 2015); `cnn_small`, the shallow CNN of the IMPALA
paper (Espeholt et al., 2018), which trains 2x (84x84 frames) to 3.5x (64x64) faster on a CPU core.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from tianji.algos.common.tensors import mlp

CNN_FEATURES = 512
SMALL_CNN_FEATURES = 256
IMAGE_MODELS = ("cnn", "cnn_small")


def shape_of(space: gym.Space) -> tuple[int, ...]:
    """A space's shape (every space TianJi trains on has one)."""
    if space.shape is None:
        raise ValueError(f"observation space {space} has no shape")
    return space.shape


def is_image(space: gym.Space) -> bool:
    return isinstance(space, gym.spaces.Box) and len(space.shape) == 3


def choose_model(obs_space: gym.Space, model: str) -> str:
    """'cnn' for image observations, 'mlp' otherwise; `model` overrides ('auto' chooses)."""
    if model == "auto":
        return "cnn" if is_image(obs_space) else "mlp"
    if model in IMAGE_MODELS and not is_image(obs_space):
        raise ValueError(
            f"algo.model {model!r} needs image observations (height, width, channels or channels "
            f"first), got shape {obs_space.shape}"
        )
    return model


def _scale(space: gym.Space) -> float:
    return 1.0 / 255.0 if space.dtype == np.uint8 else 1.0


class Flatten(nn.Module):
    """Vector observations (or any shape) as float rows."""

    def __init__(self, obs_space: gym.Space):
        super().__init__()
        self.scale = _scale(obs_space)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return obs.reshape(obs.shape[0], -1).float() * self.scale


# (out channels, kernel, stride) of each convolution.
NATURE_CONVS = ((32, 8, 4), (64, 4, 2), (64, 3, 1))
SMALL_CONVS = ((16, 8, 4), (32, 4, 2))


def pixels_seen(size: int, convs: tuple[tuple[int, int, int], ...]) -> int:
    """How many leading rows (or columns) of a `size`-pixel frame reach the output of unpadded
    convolutions: where a stride does not divide what is left, the last rows are never read."""
    outputs = [size]
    for _, kernel, stride in convs:
        outputs.append((outputs[-1] - kernel) // stride + 1)
    last = outputs[-1] - 1  # the last output position, traced back to the last input pixel it reads
    for _, kernel, stride in reversed(convs):
        last = last * stride + kernel - 1
    return last + 1


def padding_to_see_all(size: int, convs: tuple[tuple[int, int, int], ...]) -> int:
    """Zero rows to add after a frame so that the convolutions read every one of its pixels (the
    Nature CNN reads only the first 36 rows of a 40 or 42-pixel frame: Pong's own paddle at 42x42)."""
    return next(pad for pad in range(size) if pixels_seen(size + pad, convs) >= size)


class NatureCNN(nn.Module):
    """Mnih et al. (2015): 3 convolutions and a 512-unit layer; frames are channels (stacked).
    `small`: the IMPALA paper's shallow variant, 2 convolutions (16 and 32 filters) and 256 units.
    Frames whose size the strides do not fit (any size but 4 mod 8: 42, 40) are zero-padded at the
    bottom and right, so that no pixel is lost."""

    def __init__(
        self,
        obs_space: gym.Space,
        small: bool = False,
        convs: tuple[tuple[int, int, int], ...] | None = None,
        features: int | None = None,
    ):
        super().__init__()
        shape = shape_of(obs_space)
        self.channels_last = shape[-1] < shape[0]  # (84, 84, 4) rather than (4, 84, 84)
        channels, height, width = (shape[2], shape[0], shape[1]) if self.channels_last else shape
        self.scale = _scale(obs_space)
        convs = convs or (SMALL_CONVS if small else NATURE_CONVS)
        self.features = features or (SMALL_CNN_FEATURES if small else CNN_FEATURES)
        self.padding = (0, padding_to_see_all(width, convs), 0, padding_to_see_all(height, convs))
        layers: list[nn.Module] = []
        for out_channels, kernel, stride in convs:
            layers += [nn.Conv2d(channels, out_channels, kernel, stride=stride), nn.ReLU()]
            channels = out_channels
        # channels-last: oneDNN's CPU convolutions run 1.15-1.5x faster on it (forward + backward, batch 256:
        # the 7x7-map Pong CNN 4,117 -> 6,003 samples/s, the Nature CNN at 84x84 1,116 -> 1,440)
        # (torch's type stubs lack Module.to's memory_format keyword; the runtime takes it)
        self.conv = nn.Sequential(*layers, nn.Flatten()).to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        with torch.no_grad():
            flat = self.conv(self._frames(torch.zeros(1, *shape))).shape[1]
        self.fc = nn.Sequential(nn.Linear(flat, self.features), nn.ReLU())

    def _frames(self, obs: torch.Tensor) -> torch.Tensor:
        x = obs.permute(0, 3, 1, 2) if self.channels_last else obs
        x = nn.functional.pad(x, self.padding) if any(self.padding) else x
        # the layout changes while the frames are bytes (a quarter of the floats' memory traffic), and the
        # scale goes into the new float copy in place
        x = x.contiguous(memory_format=torch.channels_last)
        return x.float().mul_(self.scale) if x.dtype != torch.float32 else x * self.scale

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(self._frames(obs)))


def make_trunk(
    obs_space: gym.Space,
    hidden: list[int],
    model: str,
    activation: type[nn.Module] = nn.ReLU,
    conv: list[tuple[int, int, int]] | None = None,
    conv_features: int | None = None,
) -> tuple[nn.Module, int]:
    """A feature extractor and its width: a CNN (the Nature CNN's, the shallow one's or `conv`'s layers), or an
    MLP of `hidden` layers."""
    chosen = choose_model(obs_space, model)
    if chosen in IMAGE_MODELS:
        convs = tuple(tuple(layer) for layer in conv) if conv else None
        cnn = NatureCNN(obs_space, chosen == "cnn_small", convs, conv_features)  # type: ignore[arg-type]
        return cnn, cnn.features
    flat = int(np.prod(shape_of(obs_space)))
    if not hidden:
        return Flatten(obs_space), flat
    return nn.Sequential(Flatten(obs_space), mlp([flat, *hidden], activation), activation()), hidden[-1]


def init_orthogonal(module: nn.Module, policy_head: nn.Linear, value_head: nn.Linear) -> None:
    """Orthogonal weights and zero biases: gain sqrt(2) for ReLU/Tanh layers, 0.01 for the policy's
    last layer (a near-uniform first policy), 1 for the value's (as CleanRL, SB3 and baselines do)."""
    with torch.no_grad():
        for layer in module.modules():
            if isinstance(layer, (nn.Linear, nn.Conv2d)):
                gain = 0.01 if layer is policy_head else 1.0 if layer is value_head else np.sqrt(2)
                weight = torch.empty(layer.weight.shape)  # in a plain layout: the trunk's may be channels-last
                nn.init.orthogonal_(weight, gain)
                layer.weight.copy_(weight)
                if layer.bias is not None:
                    nn.init.zeros_(layer.bias)


def last_linear(head: nn.Module) -> nn.Linear:
    layer = head if isinstance(head, nn.Linear) else list(head.children())[-1]
    assert isinstance(layer, nn.Linear)
    return layer


class PolicyValueNet(nn.Module):
    """Policy head (categorical, or diagonal Gaussian with a learned log-std) and value head.
    MLP: separate policy and value MLPs (`pi`, `v`); CNN: one shared trunk (`body`) and two heads."""

    def __init__(
        self,
        obs_space: gym.Space,
        act_space: gym.Space,
        hidden: list[int],
        model: str = "auto",
        init: str = "default",
        conv: list[tuple[int, int, int]] | None = None,
        conv_features: int | None = None,
    ):
        super().__init__()
        self.discrete = isinstance(act_space, gym.spaces.Discrete)
        out_dim = int(act_space.n) if isinstance(act_space, gym.spaces.Discrete) else int(np.prod(shape_of(act_space)))
        if not self.discrete:
            self.log_std = nn.Parameter(torch.zeros(out_dim))
        self.shared = choose_model(obs_space, model) in IMAGE_MODELS
        if self.shared:
            self.body, width = make_trunk(obs_space, hidden, model, nn.ReLU, conv, conv_features)
            self.pi: nn.Module = nn.Linear(width, out_dim)
            self.v: nn.Module = nn.Linear(width, 1)
        else:
            self.flat = Flatten(obs_space)
            obs_dim = int(np.prod(shape_of(obs_space)))
            self.pi, self.v = mlp([obs_dim, *hidden, out_dim]), mlp([obs_dim, *hidden, 1])
        if init == "orthogonal":
            init_orthogonal(self, last_linear(self.pi), last_linear(self.v))
        else:
            with torch.no_grad():  # small last layer: near-uniform initial policy
                last_linear(self.pi).weight.mul_(0.01)
                last_linear(self.pi).bias.zero_()

    def _features(self, obs: torch.Tensor) -> torch.Tensor:
        if not self.shared:
            return self.flat(obs)
        features = self.body(obs)
        if torch.is_grad_enabled():  # training: how much of the trunk is still alive
            self.dead_units = float((features <= 0).all(0).float().mean())
        return features

    dead_units: float | None = None
    """Share of the CNN trunk's output units that were zero on every sample of the last training
    forward pass (ReLU units that died get no gradient again: a trunk that dies stops learning)."""

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.v(self._features(obs)).squeeze(-1)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self._features(obs)
        return self.pi(x), self.v(x).squeeze(-1)

    def sample(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        head, value = self(obs)
        if self.discrete:
            log_probs = torch.log_softmax(head, dim=-1)
            action = torch.multinomial(log_probs.exp(), 1)
            return action.squeeze(-1), log_probs.gather(-1, action).squeeze(-1), value
        action = head + self.log_std.exp() * torch.randn_like(head)
        return action, self._gaussian_logp(head, action), value

    def evaluate(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-prob of `action`, entropy, value under the current parameters."""
        head, value = self(obs)
        if self.discrete:
            log_probs = torch.log_softmax(head, dim=-1)
            logp = log_probs.gather(-1, action.long().unsqueeze(-1)).squeeze(-1)
            entropy = -(log_probs.exp() * log_probs).sum(-1)
            return logp, entropy, value
        entropy = (0.5 + 0.5 * np.log(2 * np.pi) + self.log_std).sum().expand(head.shape[0])
        return self._gaussian_logp(head, action), entropy, value

    def greedy(self, obs: torch.Tensor) -> torch.Tensor:
        head, _ = self(obs)
        return head.argmax(dim=-1) if self.discrete else head

    def _gaussian_logp(self, mean: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        z = (action - mean) / self.log_std.exp()
        return (-0.5 * z.pow(2) - self.log_std - 0.5 * np.log(2 * np.pi)).sum(-1)


def trunk_health(net: PolicyValueNet) -> dict[str, float]:
    """{"dead_units": ...} for a CNN trunk that has trained, nothing otherwise."""
    return {} if net.dead_units is None else {"dead_units": net.dead_units}
