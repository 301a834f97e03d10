"""What vLLM's model runner says of each row of a step (its request, sampling settings,
tokens left): pure reads of ``runner.input_batch`` and ``runner.requests``, ``None``
wherever vLLM does not say. Also which rank drafts, and the part of a draft vLLM takes."""

from __future__ import annotations

import itertools


def _batch(runner):
    return getattr(runner, "input_batch", None)


def _req_ids(runner) -> list:
    return getattr(_batch(runner), "req_ids", None) or []


def request_keys(runner, rows: list[int]) -> list:
    """Each row's request id, else ``("row", i)``."""
    ids = _req_ids(runner)
    return [ids[i] if i < len(ids) and ids[i] is not None else ("row", i) for i in rows]


def request_states(runner, rows: list[int]) -> list:
    """Each row's request state (its sampling settings, prompt length), or ``None``."""
    ids, states = _req_ids(runner), getattr(runner, "requests", None) or {}
    return [states.get(ids[i]) if i < len(ids) else None for i in rows]


def tokens_left(runner, rows: list[int], num_tokens_no_spec) -> list[int | None] | None:
    """Each row's tokens left to generate: its ``max_tokens`` less its output so far."""
    states = request_states(runner, rows)
    if all(state is None for state in states):
        return None
    out = []
    for i, state in zip(rows, states):
        limit = getattr(getattr(state, "sampling_params", None), "max_tokens", None)
        prompt = getattr(state, "num_prompt_tokens", None)
        out.append(None if limit is None or prompt is None else
                   max(0, int(limit) - (int(num_tokens_no_spec[i]) - int(prompt))))
    return out


def temperatures(runner, rows: list[int]) -> list[float] | None:
    """Each row's temperature as vLLM's input batch holds it."""
    temps = getattr(_batch(runner), "temperature_cpu", None)
    return None if temps is None else [float(temps[i]) for i in rows]


def draw_temperatures(runner, rows: list[int], temps: list[float]) -> list[float]:
    """The temperatures the drafter drafts at: 0 (the argmax, no q) for structured output,
    whose drafts vLLM cuts at the first token the grammar rejects: a cut that looks at a
    drawn token would bias the output, while a draft without q stays exact however cut."""
    out = list(temps)
    for j, state in enumerate(request_states(runner, rows)):
        params = getattr(state, "sampling_params", None)
        if getattr(params, "structured_outputs", None) is not None or \
                getattr(params, "guided_decoding", None) is not None:
            out[j] = 0.0
    return out


def seeded(req) -> bool:
    """Does ``req`` (a new request or a running one's state) sample with a seed? vLLM draws
    from its generator once per draft token, so unless ``draft_seeded`` such a request gets
    no drafts: its seed then gives plain vLLM's tokens every run."""
    params = getattr(req, "sampling_params", None)
    return getattr(params, "seed", None) is not None \
        and (getattr(params, "temperature", 0.0) or 0.0) > 1e-5


def seeded_rows(runner, rows: list[int]) -> set[int]:
    """The rows whose request samples with a seed (:func:`seeded`)."""
    if not getattr(_batch(runner), "generators", None):
        return set()  # no request of the batch has a seed
    return {i for i, state in zip(rows, request_states(runner, rows))
            if state is not None and seeded(state)}


def token_counts(runner, rows: list[int], num_tokens_no_spec) -> dict | None:
    """Each row's request id and its tokens so far."""
    ids = getattr(_batch(runner), "req_ids", None)
    if ids is None:
        return None
    return {ids[i]: int(num_tokens_no_spec[i]) for i in rows if i < len(ids)}


def valid_prefix(draft, vocab_size: int) -> list[int]:
    """The draft up to its first token outside the target's vocabulary."""
    return list(itertools.takewhile(lambda t: 0 <= t < vocab_size, map(int, draft)))


def parallel_role(vllm_config) -> tuple[bool, int]:
    """(does this rank draft?, its data-parallel rank): vLLM builds the proposer on every
    worker but uses the drafts of tensor-parallel rank 0 of the last pipeline stage."""
    dp_rank = int(getattr(getattr(vllm_config, "parallel_config", None),
                          "data_parallel_rank", 0) or 0)
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tp, pp = get_tp_group(), get_pp_group()
    except Exception:  # no vLLM, or its groups are not set up (one process, tests)
        return True, dp_rank
    return tp.rank_in_group == 0 and pp.is_last_rank, dp_rank
