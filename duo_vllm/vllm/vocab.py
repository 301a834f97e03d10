"""Draft/target vocabulary check: draft token ids go straight to the target, so the two
models must number their tokens alike. GGUF files store each token's text as Hugging Face
tokenizers' ``convert_ids_to_tokens`` does ("Ġthe", "▁the"), so the two lists compare."""

from __future__ import annotations


class VocabMismatchError(ValueError):
    """The draft and target models do not share a vocabulary."""


def check_vocab(draft_tokens: list[str], target_tokens: list[str | None],
                draft_name: str, target_name: str) -> None:
    """Raise :class:`VocabMismatchError` unless both lists are equal."""
    problems = []
    if len(draft_tokens) != len(target_tokens):
        problems.append(f"vocabulary sizes differ: draft has {len(draft_tokens)} tokens, "
                        f"target tokenizer has {len(target_tokens)}")
    diffs = [i for i, (d, t) in enumerate(zip(draft_tokens, target_tokens)) if d != t]
    if diffs:
        shown = ", ".join(f"id {i}: draft {draft_tokens[i]!r} vs target {target_tokens[i]!r}"
                          for i in diffs[:5])
        problems.append(f"{len(diffs)} token strings differ ({shown})")
    if problems:
        raise VocabMismatchError(
            f"draft model {draft_name!r} and target model {target_name!r} do not share a "
            f"vocabulary: {'; '.join(problems)}. DuoProposer needs a draft with the "
            "target's tokenizer; pick a draft GGUF of the same model family.")


def target_token_texts(tokenizer) -> list[str | None]:
    """Token strings of a Hugging Face tokenizer, by id (added tokens included)."""
    return tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
