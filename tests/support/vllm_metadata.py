"""vLLM's own sampling and spec-decode metadata built for a few rows, for tests of
the sampler and rejection-sampler patches and for benchmarks/verify_copies.py."""

import torch


def sampling_metadata(temperatures, seed=None, max_num_logprobs=None):
    """vLLM's SamplingMetadata for rows at these temperatures (0: greedy), no penalties."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    greedy = all(t == 0 for t in temperatures)
    n = len(temperatures)
    gens = {} if seed is None else {i: torch.Generator().manual_seed(seed + i) for i in range(n)}
    return SamplingMetadata(
        temperature=None if greedy else torch.tensor([float(t) for t in temperatures]),
        all_greedy=greedy, all_random=all(t > 0 for t in temperatures), top_p=None,
        top_k=None, generators=gens, max_num_logprobs=max_num_logprobs, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
        spec_token_ids=[[] for _ in range(n)])


def spec_metadata(drafts):
    """vLLM's SpecDecodeMetadata for these drafts, logits laid out as vLLM lays them:
    each request's rows at its drafts, then its bonus row."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    meta = SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
    target, bonus, start = [], [], 0
    for d in drafts:
        target += range(start, start + len(d))
        bonus.append(start + len(d))
        start += len(d) + 1
    meta.target_logits_indices = torch.tensor(target, dtype=torch.int32)
    meta.bonus_logits_indices = torch.tensor(bonus, dtype=torch.int32)
    meta.logits_indices = torch.arange(start, dtype=torch.int32)
    return meta
