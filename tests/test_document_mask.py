"""Document masking: a packed window of several documents scores each document as if it ran alone."""

import pytest
import torch

from keel.config import ModelConfig
from keel.model import CausalLM
from keel.model.document_mask import document_layout

EOS = 2
CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_pad_multiple=1)


def test_layout_from_tokens() -> None:
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, 8, 9, 10]])
    layout = document_layout(tokens, EOS)
    assert layout.positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    mask = layout.mask[0, 0]
    assert mask[3].tolist() == [False, False, False, True, False, False, False, False]
    assert mask[7].tolist() == [False] * 5 + [True] * 3
    assert mask.tril().equal(mask)


def _docs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths = [5, 9, 3, 7]
    return [
        torch.cat([torch.randint(3, 64, (n - 1,), generator=g), torch.tensor([EOS])])
        for n in lengths
    ]


@pytest.mark.parametrize("checkpoint_interval", [0, 1])
def test_packed_window_equals_each_document_alone(checkpoint_interval: int) -> None:
    torch.manual_seed(0)
    masked = CausalLM(
        CFG, seed=1, document_eos=EOS, checkpoint_interval=checkpoint_interval
    ).train()
    plain = CausalLM(CFG, seed=1).train()
    docs = _docs()
    window = torch.cat(docs)[None]
    logits = masked(window)
    start = 0
    for doc in docs:
        alone = plain(doc[None])
        torch.testing.assert_close(
            logits[0, start : start + len(doc)], alone[0], rtol=1e-5, atol=1e-5
        )
        start += len(doc)
    # gradients: the packed loss summed per token equals the sum of each document's own token losses
    labels = torch.cat([window[:, 1:], torch.full((1, 1), -100)], dim=1)
    masked(window, labels).backward()
    total = sum(len(d) for d in docs) - 1
    for i, doc in enumerate(docs):
        lab = doc[1:] if i == len(docs) - 1 else torch.cat([doc[1:], docs[i + 1][:1]])
        # the last token of a document predicts the next document's first token, as in the packed window
        if i < len(docs) - 1:
            ext = torch.cat([doc, docs[i + 1][:1]])[None]
            part = plain(ext[:, :-1], lab[None]) * len(lab) / total
        else:
            part = plain(doc[None, :-1], lab[None]) * len(lab) / total
        part.backward()
    for (name, a), (_, b) in zip(masked.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_without_eos_it_is_the_plain_causal_model() -> None:
    tokens = torch.randint(3, 64, (2, 12))
    masked, plain = CausalLM(CFG, seed=1, document_eos=EOS), CausalLM(CFG, seed=1)
    torch.testing.assert_close(masked(tokens), plain(tokens), rtol=1e-5, atol=1e-5)
