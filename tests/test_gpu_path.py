"""The GPU path's fixes of issue 64 (findings 3 to 6), with fakes: meaningful on vLLM-CPU
and on CUDA vLLM without a GPU (both test lanes)."""

from types import SimpleNamespace

import numpy as np
import pytest

from duo_vllm.config import DuoConfig, target_cores
from duo_vllm.draft.sampling import Q_MAX_BYTES, dense_q, q_fits
from tests.support.proposer_steps import FakeDraftWorker, bare

pytest.importorskip("vllm")

# vLLM-CPU's worker binds the target by these; on a GPU host they may be set for other work
BOUND = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "OMP_PLACES": "{0},{1}"}


@pytest.fixture
def platform(monkeypatch):
    """Set the platform vLLM reports: ``platform(cpu=True)``, or a GPU's."""
    from vllm.platforms import current_platform

    def set_platform(cpu: bool):
        monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: cpu)
    for name, value in BOUND.items():
        monkeypatch.setenv(name, value)
    return set_platform


# -- finding 3: the target's cores, read on vLLM's CPU platform only --------------------

@pytest.mark.parametrize("cpu", [True, False])
def test_the_targets_cores_are_read_on_the_cpu_platform_only(platform, cpu):
    from duo_vllm.vllm.draft_side import target_environ

    platform(cpu)
    env = target_environ()
    assert target_cores(env) == ([0, 1] if cpu else None)
    assert cpu or not env  # on a GPU: nothing names the target's cores


@pytest.mark.parametrize("cpu", [True, False])
def test_the_target_lends_its_cores_on_the_cpu_platform_only(platform, monkeypatch, cpu):
    """The draft on CPU 1, the end of the binding: vLLM-CPU's target lends it (its OpenMP
    threads switched by torch.set_num_threads); GPU vLLM's target has no such threads."""
    import torch

    platform(cpu)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr("duo_vllm.config.allowed_cpus", lambda: [0, 1])
    p = bare(FakeDraftWorker())
    assert p._draft_cores(DuoConfig(draft_cores=(1,), lend_cores=True)) == [1]
    assert (p._threads is not None) == cpu


# -- finding 4: the dense q, bounded; the logprob-free verification after profiling -----

def test_a_step_whose_q_is_over_the_bound_is_verified_without_it():
    vocab = 1000
    rows = Q_MAX_BYTES // (4 * vocab * 4)  # rows of 4 drafts that fit exactly
    assert q_fits([[1] * 4] * rows, vocab) and not q_fits([[1] * 4] * (rows + 1), vocab)
    assert q_fits([], vocab)
    p = bare(FakeDraftWorker(), vocab=vocab)
    q = (np.array([1, 2], dtype=np.int32), np.array([0.75, 0.25], dtype=np.float32))
    drafts = [[1, 2, 1, 1]] * (rows + 1)
    p._step_q = (list(range(rows + 1)), drafts, [[q] * 4] * (rows + 1))
    assert p.take_last_draft_probs() is None  # vLLM then takes each draft as certain
    assert p.stats()["q_dropped_steps"] == 1
    p._step_q = ([0, 1], drafts[:2], [[q] * 4, None])
    probs = p.take_last_draft_probs()
    assert tuple(probs.shape) == (2, 4, vocab) and p.stats()["q_dropped_steps"] == 1
    assert probs[0, 0, 1] == pytest.approx(0.75) and probs[1, 1, 2] == 1  # q; one-hot
    assert (probs == dense_q(drafts[:2], [[q] * 4, None], vocab)).all()


def test_verification_keeps_vllms_logits_copies_until_the_first_step(monkeypatch):
    """vLLM's profiling run (no logprobs asked) goes vLLM's way, so its memory profile
    holds the copies a step that asks for logprobs makes; from the first step on, a step
    that asks for none skips them."""
    from duo_vllm.vllm import patches

    monkeypatch.setattr(patches, "_armed", [False])
    seen = []

    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        seen.append(self.is_processed_logprobs_mode)

    verify = patches.with_logprob_free_verify(forward)
    sampler = SimpleNamespace(is_processed_logprobs_mode=False, sampler=SimpleNamespace())
    no_logprobs = SimpleNamespace(max_num_logprobs=None, logprob_token_ids=None)
    verify(sampler, None, None, None, no_logprobs)  # the profiling run
    patches.arm_logprob_free_verify()
    verify(sampler, None, None, None, no_logprobs)
    assert seen == [False, True] and not sampler.is_processed_logprobs_mode


def test_the_first_propose_arms_it(monkeypatch):
    from duo_vllm.vllm import patches

    monkeypatch.setattr(patches, "_armed", [False])
    p = bare(FakeDraftWorker())
    p.propose([[1]], np.array([3]), np.zeros((1, 8), dtype=np.int32))
    assert patches._armed[0]


# -- finding 5: Model Runner V2 forced by a HiSparse or watermark config ---------------

def test_v2_forced_by_a_hisparse_or_watermark_config_names_it():
    from duo_vllm.vllm.checks import UnsupportedVllmError, check_vllm, v2_forced_by

    plain = SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=None),
                            watermark_config=None)
    assert v2_forced_by(plain) is None
    hisparse = SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=object()))
    assert "HiSparse" in v2_forced_by(hisparse)
    VllmConfig = type("VllmConfig", (), {"__module__": "vllm.config.vllm",
                                         "use_v2_model_runner": True,
                                         "watermark_config": object()})
    with pytest.raises(UnsupportedVllmError, match=r"runs Model Runner V2 whenever a "
                       r"watermark config \(watermark_config\) is set.*Fix: remove a watermark"):
        check_vllm(VllmConfig())


# -- finding 6: a row within k tokens of max_model_len --------------------------------

def test_drafts_stay_within_what_vllm_drafts_after_and_a_long_row_is_counted():
    """vLLM calls propose() for the next step only if max(length + drafts) + k fits
    max_model_len; else the whole batch gets k placeholder drafts a row, unseen here."""
    p = bare(FakeDraftWorker([[9] * 4, [9] * 4]), k=4)  # max_model_len 100
    ctx = np.zeros((2, 100), dtype=np.int32)
    drafts = p.propose([[1], [1]], np.array([10, 94]), ctx)
    assert [len(d) for d in drafts] == [4, 2]  # 94 + 2 + 4 = 100: vLLM drafts next step
    assert p.stats()["unfit_steps"] == 0
    drafts = p.propose([[1], [1]], np.array([11, 97]), ctx)
    assert drafts[1] == [] and p.stats()["unfit_steps"] == 1  # 97 + 4 > 100
