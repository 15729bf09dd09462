"""Returns and value targets every algorithm shares: pure math, each tested against a reference.

- `vtrace` (Espeholt et al., 2018): off-policy corrected value targets and policy-gradient advantages
  for fragments produced by an older policy (IMPALA, APPO).
- `compute_gae`: generalised advantage estimation (PPO, MAPPO).
- `td_lambda_targets`: TD(lambda) targets over a sequence (QMIX).
- `nstep_transitions`: n-step returns cut from a fragment (DQN / Ape-X).

Fragments follow the actor's recording convention (tianji.runtime.roles.actor): the row after an
episode's last step holds its final observation and is invalid. So at a done row the traces are
cut (nothing flows back from the next episode), a terminated step bootstraps from zero and a
truncated one from V(final observation) = values[t + 1].

    vs, pg_advantages = vtrace(behaviour_logp, target_logp, rewards, values, bootstrap_value,
                               dones, terminated, gamma=0.99, lam=1.0, rho_bar=1.0, c_bar=1.0)
"""

from __future__ import annotations

import numpy as np
import torch


@torch.no_grad()
def vtrace(
    behaviour_logp: torch.Tensor,
    target_logp: torch.Tensor,
    rewards: torch.Tensor,
    values: torch.Tensor,
    bootstrap_value: torch.Tensor,
    dones: torch.Tensor,
    terminated: torch.Tensor,
    gamma: float,
    lam: float = 1.0,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
    pg_rho_bar: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Value targets v_s and advantages rho_s (r_s + gamma v_{s+1} - V(x_s)), arrays shaped [T, k].

    rho_t = min(rho_bar, pi/mu), c_t = lam min(c_bar, pi/mu) (0 at a done row: the trace stops),
    delta_t = rho_t (r_t + gamma_t V(x_{t+1}) - V(x_t)) with gamma_t = 0 after termination,
    v_t - V(x_t) = delta_t + gamma_t c_t (v_{t+1} - V(x_{t+1})).
    The advantage bootstraps from v_{t+1}, or from V(x_{t+1}) at a done row.
    """
    T = rewards.shape[0]
    ratio = (target_logp - behaviour_logp).exp()
    rho = ratio.clamp(max=rho_bar)
    not_done = 1.0 - dones.to(values.dtype)
    discounts = gamma * (1.0 - terminated.to(values.dtype))
    c = lam * ratio.clamp(max=c_bar) * not_done
    next_values = torch.cat([values[1:], bootstrap_value[None]], dim=0)
    deltas = rho * (rewards + discounts * next_values - values)
    corrections = torch.zeros_like(values)
    running = torch.zeros_like(bootstrap_value)
    for t in reversed(range(T)):
        running = deltas[t] + discounts[t] * c[t] * running
        corrections[t] = running
    vs = values + corrections
    next_vs = torch.cat([vs[1:], bootstrap_value[None]], dim=0)
    next_target = torch.where(dones.bool(), next_values, next_vs)
    pg_rho = ratio.clamp(max=rho_bar if pg_rho_bar is None else pg_rho_bar)
    return vs, pg_rho * (rewards + discounts * next_target - values)


def compute_gae(
    rewards: np.ndarray,
    values: np.ndarray,
    bootstrap_value: np.ndarray,
    dones: np.ndarray,
    terminated: np.ndarray,
    gamma: float,
    lam: float,
    traces: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Advantages and value targets for one fragment, arrays shaped [T, k].

    `values[t + 1]` (or `bootstrap_value` after the last row) is the value of the
    state reached at step t; a terminated step bootstraps from zero, and a done or terminated
    step stops the recursion so episodes (and an Atari game's lives, env.episodic_life) never leak
    into each other.
    `traces` [T, k] (none: 1): how far row t's action lets the advantage of row t - 1 look past it,
    e.g. min(1, pi / mu) to cut the trace where the policy trained would not have acted as the actor
    did (Retrace's and V-trace's c_t): A_t = delta_t + gamma lam c_{t+1} A_{t+1}.
    """
    T = rewards.shape[0]
    next_values = np.concatenate([values[1:], bootstrap_value[None]], axis=0)
    not_terminal = 1.0 - terminated.astype(np.float32)
    not_done = (1.0 - dones.astype(np.float32)) * not_terminal  # a terminal that is no episode end cuts too
    if traces is not None:  # row t's recursion reads row t + 1's trace (nothing follows the last row)
        not_done = not_done * np.concatenate([traces[1:], np.ones_like(traces[:1])], axis=0)
    deltas = rewards + gamma * next_values * not_terminal - values
    advantages = np.zeros_like(values, dtype=np.float32)
    running = np.zeros_like(values[0], dtype=np.float32)
    for t in reversed(range(T)):
        running = deltas[t] + gamma * lam * not_done[t] * running
        advantages[t] = running
    return advantages, (advantages + values).astype(np.float32)


def td_lambda_targets(
    rewards: torch.Tensor,
    target_q: torch.Tensor,
    bootstrap_q: torch.Tensor,
    dones: torch.Tensor,
    terminated: torch.Tensor,
    gamma: float,
    lam: float,
) -> torch.Tensor:
    """TD(lambda) returns of one team, arrays shaped [T, B]; `target_q[t]` = Q_tot_target of the state
    reached at step t (row t + 1's), `bootstrap_q` that of the state after the sequence.

    G_t = r_t + gamma * (1 - term_t) * ((1 - lam) Q_{t+1} + lam G_{t+1}); at a done step the
    recursion stops (a truncated episode bootstraps from Q_{t+1}, the value of its final state)."""
    T = rewards.shape[0]
    returns = torch.zeros_like(rewards)
    running = bootstrap_q
    not_term = 1.0 - terminated.to(rewards.dtype)
    for t in reversed(range(T)):
        next_q = target_q[t]
        blended = torch.where(dones[t].bool(), next_q, (1 - lam) * next_q + lam * running)
        running = rewards[t] + gamma * not_term[t] * blended
        returns[t] = running
    return returns


def nstep_transitions(
    rewards: np.ndarray,
    terminated: np.ndarray,
    dones: np.ndarray,
    valid: np.ndarray,
    gamma: float,
    n: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n-step returns for every start row of a [T, k] fragment.

    Returns `(returns, discounts, steps)`: the discounted sum of up to n rewards
    (fewer when the episode or the fragment ends first), the discount to apply to
    the bootstrap value (gamma**steps, or 0 after termination), and how many steps
    were taken, so the bootstrap state is row `t + steps` (row T = the obs after the
    fragment). After a truncation that row holds the final observation (the actor's
    recording convention), so truncated episodes bootstrap correctly.
    """
    T, k = rewards.shape
    rows = np.arange(T)[:, None]
    cols = np.arange(k)[None, :]
    returns = np.zeros((T, k), dtype=np.float32)
    steps = np.zeros((T, k), dtype=np.int64)
    ended_by_termination = np.zeros((T, k), dtype=bool)
    active = valid.astype(bool).copy()
    for i in range(n):
        idx = rows + i
        in_fragment = idx < T
        idx = np.minimum(idx, T - 1)
        stepping = active & in_fragment
        returns += np.where(stepping, (gamma**i) * rewards[idx, cols], 0.0).astype(np.float32)
        steps += stepping
        ended_by_termination |= stepping & terminated[idx, cols]
        active = stepping & ~(dones[idx, cols] | terminated[idx, cols])  # a lost life ends the sum too
    discounts = np.where(ended_by_termination, 0.0, gamma**steps).astype(np.float32)
    return returns, discounts, steps
