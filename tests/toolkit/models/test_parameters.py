"""The names a model's parameters go by (toolkit.models.parameters)."""

from __future__ import annotations

from toolkit.models.parameters import parameter_names


def test_a_tied_embedding_and_head_are_one_parameter_with_two_names(tiny_model):
    tied, untied = tiny_model("llama", tie_word_embeddings=True), tiny_model("llama", tie_word_embeddings=False)
    names = parameter_names(tied)
    assert ["model.embed_tokens.weight", "lm_head.weight"] in names.values()
    assert len(names) == len(list(tied.parameters())) == len(list(untied.parameters())) - 1
    assert all(len(n) == 1 for n in parameter_names(untied).values())
    assert [n[0] for n in names.values()] == [n for n, _ in tied.named_parameters()]
