"""APPO: asynchronous PPO, the algorithm RLlib and Sample Factory use for Atari. IMPALA's actors and
V-trace targets, PPO's clipped surrogate and several passes over each batch.

Per batch: one forward pass (no gradient) with the learner's current parameters gives values and
the V-trace targets and advantages (`tianji.algos.impala.vtrace_targets`), corrected for the actors'
older policies. Then `epochs` passes of `minibatches` gradient steps on random samples of the
batch: PPO's loss (`tianji.algos.ppo.ppo_loss`) with the ratio pi / mu to the behaviour policy that
made the data, normalised advantages, the value regressed to the V-trace targets.
"""

from __future__ import annotations

import torch

from tianji.algos.common.networks import trunk_health
from tianji.algos.impala import IMPALALearner, minibatch_steps, time_major_batch, vtrace_targets
from tianji.algos.ppo import ppo_loss


class APPOLearner(IMPALALearner):
    def update(self) -> dict[str, float]:
        samples, diagnostics = vtrace_targets(self.net, time_major_batch(self.take_batch(), self.device), self.cfg)
        return {**minibatch_steps(samples, self.cfg, self._minibatch_loss, self.step, self.sync, self.env_steps),
                **diagnostics, **trunk_health(self.net)}

    def _minibatch_loss(self, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logp, entropy, values = self.net.evaluate(b["obs"], b["action"])
        return ppo_loss(logp, b["logp"], b["adv"], values, b["vs"], entropy, self.cfg, b["value"])
