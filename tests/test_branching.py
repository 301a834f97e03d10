"""The θ rule, the budget split and branch selection, by hand."""

import numpy as np
import pytest

from duo_vllm.draft.branching import (
    Branch, Tree, branch_candidates, miss_reason, select_branch, split_budget,
    top_candidates,
)


def logits_for(probs: dict[int, float], n: int = 16) -> np.ndarray:
    """Logits whose softmax puts exactly ``probs`` on the given ids (rest shared evenly)."""
    rest = (1.0 - sum(probs.values())) / (n - len(probs))
    p = np.full(n, rest)
    for i, v in probs.items():
        p[i] = v
    return np.log(p).astype(np.float32)


def test_top_candidates_are_sorted_softmax_probabilities():
    ids, probs = top_candidates(logits_for({3: 0.5, 7: 0.3, 1: 0.1}), k=3)
    assert list(ids) == [3, 7, 1]
    np.testing.assert_allclose(probs, [0.5, 0.3, 0.1], rtol=1e-5)


def test_theta_rule_keeps_candidates_above_theta():
    ids = np.array([3, 7, 1, 9])
    probs = np.array([0.5, 0.3, 0.1, 0.05])
    # θ = 0.5 * 0.4 = 0.2: 7 (0.3) branches, 1 (0.1) does not
    assert branch_candidates(ids, probs, p2_top=0.4, max_branches=4) == [3, 7]
    # a confident draft (θ = 0.5 * 0.95) keeps one branch
    assert branch_candidates(ids, probs, p2_top=0.95, max_branches=4) == [3]
    # an unsure one (θ = 0.5 * 0.1 = 0.05) opens three; 0.05 is not > θ
    assert branch_candidates(ids, probs, p2_top=0.1, max_branches=4) == [3, 7, 1]
    assert branch_candidates(ids, probs, p2_top=0.1, max_branches=2) == [3, 7]
    assert branch_candidates(np.array([]), np.array([]), 0.5, 4) == []


@pytest.mark.parametrize("total, weights, alpha, cap, want", [
    # a confident top-1: every evaluation extends it (0.9 * 0.8**3 > 0.1)
    (4, [0.9, 0.1], 0.8, 4, [4, 0]),
    # 0.5 > 0.4 (= 0.5 * 0.8) > 0.35: two to the top-1, then 0.35 > 0.32 (= 0.5 * 0.8**2)
    (3, [0.5, 0.35], 0.8, 4, [2, 1]),
    (3, [0.5, 0.3], 0.8, 4, [3, 0]),  # 0.3 < 0.32: the second branch gets nothing
    (6, [0.4, 0.35, 0.25], 0.8, 4, [3, 2, 1]),
    (20, [0.9, 0.1], 0.8, 4, [4, 4]),  # capped
    (0, [1.0], 0.8, 4, [0]),
    (5, [1.0], 0.8, 3, [3]),
    (2, [0.5, 0.5], 0.9, 4, [1, 1]),  # ties go to the earlier branch first
])
def test_split_budget(total, weights, alpha, cap, want):
    got = split_budget(total, weights, cap, alpha)
    assert got == want
    assert sum(got) == min(total, cap * len(weights))


def test_select_branch_needs_full_acceptance_and_a_matching_first_token():
    tree = Tree(np.array([1, 2, 3]), [Branch([7, 8, 9], 0), Branch([5, 6], 9)])
    assert select_branch(tree, np.array([1, 2, 3, 5])).tokens == [5, 6]
    assert select_branch(tree, np.array([1, 2, 3, 7])).seq_id == 0
    assert select_branch(tree, np.array([1, 2, 3, 4])) is None  # sampled outside the branches
    assert select_branch(tree, np.array([1, 2, 7])) is None  # partial accept
    assert select_branch(tree, np.array([1, 2, 4, 7])) is None  # different prefix
    assert select_branch(None, np.array([1])) is None
    # and why not, where it finds none
    assert miss_reason(tree, np.array([1, 2, 3, 4])) == "bonus"
    assert miss_reason(tree, np.array([1, 2, 7])) == "rejected"
    assert miss_reason(tree, np.array([1, 2, 4, 7])) == "rejected"
    assert miss_reason(tree, np.array([1, 2, 3, 5, 6])) == "rejected"  # a token too many
    assert miss_reason(None, np.array([1])) == "no_tree"


def test_select_branch_follows_a_branch_for_several_tokens_with_one_left_to_serve():
    """A tree rooted inside the draft served: the target's accepted tokens and its own
    next one may run along a branch."""
    tree = Tree(np.array([1, 2]), [Branch([5, 6, 7], 0), Branch([8, 9], 4)])
    assert select_branch(tree, np.array([1, 2, 5, 6])).seq_id == 0  # 7 left to serve
    assert select_branch(tree, np.array([1, 2, 5, 6, 7])) is None  # nothing left
    assert select_branch(tree, np.array([1, 2, 5, 9])) is None  # off the branch
    assert select_branch(tree, np.array([1, 2, 8])).seq_id == 4  # as before
