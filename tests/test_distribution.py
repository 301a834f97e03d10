"""Sampling with DuoProposer keeps the target's distribution (temperature 1, top-p 0.9).

Many short continuations of two prompts are sampled with plain vLLM and with
DuoProposer (same engine settings, fixed per-request seeds). The frequencies
of the 1st, 2nd and 3rd generated tokens are compared with a chi-square test
of homogeneity. The 1st token comes from the prefill; the 2nd and 3rd go
through speculative verification.

This test found a vLLM-CPU bug: its ``expand_kernel`` override drops its
output, so the rejection sampler verified sampled requests against
uninitialised temperatures (the output was biased toward the draft tokens).
DuoProposer fixes it at start-up (``duo_vllm/vllm/patches.py``). With the
bug the bias depended on what the uninitialised memory held, so the control
is deterministic instead: ``tests/support/lossy_proposer.py`` drafts like DuoProposer
and makes verification use temperature 0.5 (vLLM's lossy "synthetic"
rejection method is not supported on CPU); the test must reject it.
"""

from collections import Counter

import pytest
from scipy.stats import chi2_contingency

from duo_vllm.cli import speculative_config
from tests.support.engines import run_vllm
from duo_vllm.config import nest_tuning

pytestmark = pytest.mark.e2e

PROMPTS = ["Once upon a time, there was a", "My favourite thing to eat is"]
SAMPLES = 300  # per prompt and method
POSITIONS = (0, 1, 2)
P_MIN = 1e-3  # equal distributions: fail at most 1 in 1000 (seeds are fixed anyway)
ENDED = -1  # a position after the continuation's end


def sample(session_tmp, target_dir, name, spec):
    prompts = [p for p in PROMPTS for _ in range(SAMPLES)]
    out = run_vllm(session_tmp, name, target=target_dir, prompts=prompts, max_tokens=3,
                   temperature=1.0, top_p=0.9, seeds=list(range(len(prompts))),
                   max_num_seqs=16, speculative_config=spec, timeout=1200)
    # a continuation that ended early (EOS is a token of the target's distribution too)
    # has ENDED at the later positions: an outcome of its own, compared like any token
    ids = [(o[0] + [ENDED] * len(POSITIONS))[:len(POSITIONS)] for o in out["token_ids"]]
    return {p: ids[i * SAMPLES:(i + 1) * SAMPLES] for i, p in enumerate(PROMPTS)}, out


def homogeneity_p(a: list[int], b: list[int], min_count: int = 10) -> float:
    """Chi-square test p-value that two samples of tokens share a distribution."""
    ca, cb = Counter(a), Counter(b)
    keep = [t for t in set(ca) | set(cb) if ca[t] + cb[t] >= min_count]
    rows = [[ca[t] for t in keep], [cb[t] for t in keep]]
    rows[0].append(len(a) - sum(rows[0]))  # everything rarer, pooled
    rows[1].append(len(b) - sum(rows[1]))
    if rows[0][-1] + rows[1][-1] == 0:
        rows = [r[:-1] for r in rows]
    if len(rows[0]) < 2:
        return 1.0  # a single category on both sides: identical
    return float(chi2_contingency(rows)[1])


def p_values(ref, other):
    return {(p, pos): homogeneity_p([s[pos] for s in ref[p]], [s[pos] for s in other[p]])
            for p in PROMPTS for pos in POSITIONS}


@pytest.fixture(scope="module")
def plain_samples(session_tmp, target_dir):
    return sample(session_tmp, target_dir, "dist_plain", None)[0]


# Parallel mode, drafting on every step it can, whatever the actor's answer
# time (``propose_timeout_s`` 120: the default bound would skip drafts while the
# actor prefills 16 new prompts), with a fixed budget of 4 tokens (the
# hardware-aware budget rightly drafts almost nothing for 16 sampled requests
# on one draft core, which would leave the test without power). It pre-drafts
# branch trees while vLLM verifies and serves them on a hit (the path the
# default configuration takes), and on a miss drafts a chain while vLLM waits
# (serial mode's path): the test checks that both kinds of drafts were served.
# The lossy control runs the same mode and must show the same drafts served, so
# its rejection shows the test's power where the test runs. Both draw the
# drafts from the draft's q and hand q to the rejection sampler
# (duo_vllm/draft/sampling.py); the lossy control's drafts are drawn too. The
# requests carry seeds (fixed draws): ``draft_seeded`` drafts them (by default a
# seeded sampled request decodes without drafts, tests/test_serve.py).
MODE = {"parallel": True, "multi_sequence": True, "budget": 4, "propose_timeout_s": 120,
        "draft_seeded": True}
LOSSY = "tests.support.lossy_proposer.LossyDuoProposer"


def duo_spec(model: str = "duo_vllm.DuoProposer") -> dict:
    return dict(speculative_config(4, nest_tuning({"max_sequences": 16, **MODE})), model=model)


def assert_drafts_served(out) -> None:
    """What the test's verdict rests on, for the test and its control alike."""
    stats = out["draft_stats"]
    assert out["metrics"]["accepted"] > 0, out["metrics"]  # drafts were really verified
    # drawn from the draft's q and verified with it (sampled_drafts, the default)
    assert stats["drawn_tokens"] > 0, stats
    # both kinds were served: pre-drafted branches (hits) and chains drafted on demand
    # while vLLM waited (misses: serial mode's path)
    assert stats["predraft_hits"] > 0 and stats["sync_tokens"] > 0, stats


def test_duo_sampling_matches_plain_distribution(session_tmp, target_dir, plain_samples):
    duo, out = sample(session_tmp, target_dir, "dist_duo_parallel", duo_spec())
    assert_drafts_served(out)
    pv = p_values(plain_samples, duo)
    assert min(pv.values()) > P_MIN, pv


def test_the_distribution_test_catches_a_lossy_proposer(session_tmp, target_dir, plain_samples):
    lossy, out = sample(session_tmp, target_dir, "dist_lossy_parallel", duo_spec(LOSSY))
    assert_drafts_served(out)  # the same mode as the test, its drafts served the same ways
    pv = p_values(plain_samples, lossy)
    # the decision rule of test_duo_sampling_matches_plain_distribution rejects it
    assert min(pv.values()) < P_MIN, pv
