"""Episodes in the order of a deterministic schedule, whatever order the actors' events came in.

Under `balance.schedule: deterministic` fragment k of actor i comes before fragment k of actor i + 1,
which comes before fragment k + 1 of actor 0. An episode is *settled* once every fragment before the
one it ended in has been reported: no episode can still come in ahead of it. Settled episodes are
released in that order, so the training mean of the last episodes at each point, and the env step at
which it first reaches a target, are the same in every run of the seed.

    order = ScheduledEpisodes(actors=2, window=100)
    for mean, env_steps in order.report(actor=1, fragments=1, env_steps=1024, episodes=[(21.0, 812)], ended_in=[0]):
        ...   # each settled episode: the mean of the last `window` (once there are that many) and the
              # env steps of the schedule up to the fragment it ended in
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any


class ScheduledEpisodes:
    def __init__(self, actors: int, window: int):
        self.actors = actors
        self.steps_per_fragment = 0  # every fragment's env steps (one layout): learnt from the first report
        self.reported = [0] * actors  # fragments each actor has reported
        self.returns: deque[float] = deque(maxlen=window)
        self._waiting: list[tuple[int, int, int, Any]] = []  # heap of (fragment k, actor, arrival, episode)
        self._arrivals = 0

    def report(
        self,
        actor: int,
        fragments: int,
        env_steps: int,
        episodes: Sequence[Sequence[float]],
        ended_in: Sequence[int],
    ) -> Iterator[tuple[float | None, int]]:
        """One actor event: `fragments` more fragments made (`env_steps` in all), and the episodes that
        ended in them (with the number k of the fragment each ended in). Yields, for each episode it
        settles, in the schedule's order: the mean return of the last `window` settled episodes (None
        before there are that many), and the schedule's env steps up to the end of the fragment the
        episode ended in."""
        if not 0 <= actor < self.actors:
            return  # an id outside the layout cannot be placed in the order
        self.reported[actor] += fragments
        if fragments and not self.steps_per_fragment:
            self.steps_per_fragment = env_steps // fragments
        for episode, k in zip(episodes, ended_in, strict=False):
            heapq.heappush(self._waiting, (int(k), actor, self._arrivals, episode))
            self._arrivals += 1
        first_missing = min((k, i) for i, k in enumerate(self.reported))
        while self._waiting and self._waiting[0][:2] < first_missing:
            k, i, _, episode = heapq.heappop(self._waiting)
            self.returns.append(float(episode[0]))
            full = len(self.returns) == self.returns.maxlen
            yield (sum(self.returns) / len(self.returns) if full else None), self.env_steps_through(k, i)

    def env_steps_through(self, k: int, actor: int) -> int:
        """The env steps of every fragment up to and including actor `actor`'s k-th, in the schedule's order."""
        return (k * self.actors + actor + 1) * self.steps_per_fragment

    def all_episodes_mean(self) -> float | None:
        """The mean of the last `window` episodes in the schedule's order, settled or not (at the end of a
        run whose every fragment has reported, the two agree)."""
        waiting = [item[3][0] for item in sorted(self._waiting)]
        last = [*self.returns, *waiting][-(self.returns.maxlen or 1) :]
        return sum(last) / len(last) if last else None
