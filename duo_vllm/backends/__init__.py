"""Draft model backends.

A backend is the thin layer over one inference engine that keeps several
token sequences with their KV caches. It knows nothing of requests, slots or
drafting policy; :mod:`duo_vllm.drafter` builds those on top of it.

Backend protocol (duck-typed)::

    n_vocab: int                                  # logits width
    name: str                                     # for messages
    token_texts() -> list[str]                    # vocabulary, by token id
    truncate(seq_id, n) -> None                   # keep the first n tokens of a sequence
    eval(seq_id, tokens, pos) -> np.ndarray       # append tokens at pos; logits after the last
"""
