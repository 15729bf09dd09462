"""V-trace (Espeholt et al., 2018): off-policy corrected value targets and policy-gradient advantages
for fragments produced by an older policy. Pure tensor math, tested against a NumPy reference.

Fragments follow the actor's recording convention (tianji.runtime.roles.actor): the row after an
episode's last step holds its final observation and is invalid. So at a done row the traces are
cut (nothing flows back from the next episode), a terminated step bootstraps from zero and a
truncated one from V(final observation) = values[t + 1].

    vs, pg_advantages = vtrace(behaviour_logp, target_logp, rewards, values, bootstrap_value,
                               dones, terminated, gamma=0.99, lam=1.0, rho_bar=1.0, c_bar=1.0)
"""

from __future__ import annotations

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
