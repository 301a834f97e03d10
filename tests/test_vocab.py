import pytest

from duo_vllm.vllm.vocab import VocabMismatchError, check_vocab


def test_equal_vocab_passes():
    check_vocab(["a", "b"], ["a", "b"], "d.gguf", "t")


def test_size_mismatch_names_both_models():
    with pytest.raises(VocabMismatchError, match=r"'d.gguf'.*'tgt'.*draft has 2 tokens, target tokenizer has 3"):
        check_vocab(["a", "b"], ["a", "b", "c"], "d.gguf", "tgt")


def test_string_mismatch_shows_examples():
    with pytest.raises(VocabMismatchError, match=r"1 token strings differ \(id 1: draft 'b' vs target 'x'\)"):
        check_vocab(["a", "b"], ["a", "x"], "d", "t")
