"""Stand-ins for vLLM's parallel groups and config, for DuoProposer's start-up
without an engine: which rank drafts, and what it hands the actor."""

from types import SimpleNamespace


def fake_groups(monkeypatch, tp_rank, last_pp=True):
    import vllm.distributed.parallel_state as ps

    monkeypatch.setattr(ps, "get_tp_group", lambda: SimpleNamespace(rank_in_group=tp_rank))
    monkeypatch.setattr(ps, "get_pp_group", lambda: SimpleNamespace(is_last_rank=last_pp))


def spec_config(dp_rank=0):
    load = SimpleNamespace(model_loader_extra_config={"duo": {}})
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=4, draft_load_config=load),
        model_config=SimpleNamespace(max_model_len=2048, get_vocab_size=lambda: 49152),
        parallel_config=SimpleNamespace(data_parallel_rank=dp_rank))
