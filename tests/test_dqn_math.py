"""DQN family math and prioritized replay against hand-computed references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tianji.algos.common.replay import PrioritizedReplay, SumTree
from tianji.algos.common.returns import nstep_transitions
from tianji.algos.dqn import double_q_targets, epsilon_ladder, td_loss


def test_nstep_returns_hand_computed():
    # one env, T=5: rewards 1,2,3,4,5; episode terminates at step 2 (row 3 is the reset row)
    rewards = np.array([[1.0], [2.0], [3.0], [0.0], [5.0]], np.float32)
    terminated = np.array([[0], [0], [1], [0], [0]], bool)
    valid = np.array([[1], [1], [1], [0], [1]], bool)
    returns, discounts, steps = nstep_transitions(rewards, terminated, terminated, valid, gamma=0.5, n=2)
    np.testing.assert_allclose(returns[:, 0], [1 + 0.5 * 2, 2 + 0.5 * 3, 3, 0, 5])
    np.testing.assert_allclose(discounts[:, 0], [0.25, 0.0, 0.0, 1.0, 0.5])  # termination -> no bootstrap
    np.testing.assert_array_equal(steps[:, 0], [2, 2, 1, 0, 1])  # last row: cut short by the fragment end


def test_nstep_truncation_bootstraps_from_the_final_observation_row():
    rewards = np.array([[1.0], [1.0], [0.0]], np.float32)
    done = np.array([[0], [1], [0]], bool)  # truncated (not terminated) at step 1
    valid = np.array([[1], [1], [0]], bool)
    returns, discounts, steps = nstep_transitions(rewards, np.zeros_like(done), done, valid, gamma=0.9, n=3)
    assert returns[0, 0] == pytest.approx(1.9)
    assert steps[0, 0] == 2 and discounts[0, 0] == pytest.approx(0.81)  # bootstrap state = row 2 = final obs


def test_double_q_targets_reference():
    rewards = torch.tensor([1.0, 0.0])
    discounts = torch.tensor([0.9, 0.0])
    online = torch.tensor([[1.0, 5.0], [3.0, 0.0]])
    target = torch.tensor([[2.0, 4.0], [7.0, 8.0]])
    np.testing.assert_allclose(double_q_targets(rewards, discounts, online, target, double=True), [1 + 0.9 * 4, 0.0])
    np.testing.assert_allclose(double_q_targets(rewards, discounts, online, target, double=False), [1 + 0.9 * 4, 0.0])
    online = torch.tensor([[5.0, 1.0], [3.0, 0.0]])  # online argmax picks action 0: double Q values it at 2
    assert double_q_targets(rewards, discounts, online, target, double=True)[0] == pytest.approx(1 + 0.9 * 2)
    assert double_q_targets(rewards, discounts, online, target, double=False)[0] == pytest.approx(1 + 0.9 * 4)


def test_td_loss_is_weighted_huber():
    q = torch.tensor([0.0, 0.0, 0.0], requires_grad=True)
    targets = torch.tensor([0.5, 3.0, -2.0])
    weights = torch.tensor([1.0, 0.5, 2.0])
    loss, td = td_loss(q, targets, weights)
    expected = (1.0 * 0.5 * 0.25 + 0.5 * (3.0 - 0.5) + 2.0 * (2.0 - 0.5)) / 3
    assert loss.item() == pytest.approx(expected)
    np.testing.assert_allclose(td, [0.5, 3.0, -2.0])


def test_epsilon_ladder_matches_apex_formula():
    assert epsilon_ladder(0, 8, 0.4, 7.0) == pytest.approx(0.4)
    assert epsilon_ladder(7, 8, 0.4, 7.0) == pytest.approx(0.4**8)
    assert epsilon_ladder(3, 8, 0.4, 7.0) == pytest.approx(0.4 ** (1 + 7 * 3 / 7))
    assert epsilon_ladder(0, 1, 0.4, 7.0) == 0.4


def test_sum_tree_invariants_after_batched_updates():
    rng = np.random.default_rng(0)
    tree = SumTree(1000)
    assert tree.size == 1024
    values = np.zeros(tree.size)
    for _ in range(20):
        idx = rng.integers(0, 1000, 64)
        new = rng.random(64)
        tree.update(idx, new)
        values[idx] = new  # duplicates: last write wins, as in the tree
        np.testing.assert_allclose(tree.leaves(np.arange(1000)), values[:1000])
        for level in range(tree.depth):  # every inner node is the sum of its children
            nodes = np.arange(1 << level, 1 << (level + 1))
            np.testing.assert_allclose(tree.nodes[nodes], tree.nodes[2 * nodes] + tree.nodes[2 * nodes + 1])
    assert tree.total == pytest.approx(values.sum())


def test_sum_tree_find_returns_the_leaf_holding_each_prefix():
    tree = SumTree(4)
    tree.update(np.arange(4), np.array([1.0, 0.0, 2.0, 3.0]))
    np.testing.assert_array_equal(tree.find(np.array([0.0, 0.99, 1.0, 2.5, 3.0, 5.99])), [0, 0, 2, 2, 3, 3])


def test_prioritized_sampling_is_proportional():
    replay = PrioritizedReplay(8, {"x": ((), np.int64)}, alpha=1.0, eps=0.0)
    priorities = np.array([1, 2, 3, 4, 0, 0, 5, 5], np.float64)
    replay.add({"x": np.arange(8)}, priorities)
    rng = np.random.default_rng(123)
    counts = np.zeros(8)
    for _ in range(400):
        idx, batch, _ = replay.sample(50, beta=0.4, rng=rng)
        np.testing.assert_array_equal(batch["x"], idx)
        counts += np.bincount(idx, minlength=8)
    expected = priorities / priorities.sum() * counts.sum()
    assert counts[4] == counts[5] == 0
    chi2 = (((counts - expected) ** 2)[expected > 0] / expected[expected > 0]).sum()
    assert chi2 < 20.5  # 99.9th percentile of chi-square with 5 degrees of freedom


def test_importance_weights_and_priority_update_round_trip():
    replay = PrioritizedReplay(4, {"x": ((), np.float32)}, alpha=0.5, eps=0.0)
    replay.add({"x": np.zeros(4, np.float32)}, np.array([1.0, 4.0, 9.0, 16.0]))
    np.testing.assert_allclose(replay.tree.leaves(np.arange(4)), [1, 2, 3, 4])  # p ** alpha
    idx, _, weights = replay.sample(4, beta=1.0, rng=np.random.default_rng(0))
    probs = replay.tree.leaves(idx) / replay.tree.total
    expected = (4 * probs) ** -1.0
    np.testing.assert_allclose(weights, expected / expected.max(), rtol=1e-6)
    replay.update_priorities(np.array([0, 3]), np.array([-25.0, 0.0]))  # |td|
    np.testing.assert_allclose(replay.tree.leaves(np.arange(4)), [5, 2, 3, 0])
    assert replay.tree.total == pytest.approx(10)


def test_replay_ring_buffer_overwrites_oldest():
    replay = PrioritizedReplay(5, {"x": ((), np.int64)}, alpha=0.6)
    replay.add({"x": np.arange(3)})
    replay.add({"x": np.arange(3, 7)})
    assert len(replay) == 5
    assert sorted(replay.data["x"].tolist()) == [2, 3, 4, 5, 6]
