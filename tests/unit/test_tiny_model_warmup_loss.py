"""rlrun_runtime.tiny_model.get_warmup_loss: smoothed cross-entropy over the tokenizer's ids only."""

import pytest
import torch

from rlrun_runtime.tiny_model import get_warmup_loss


def batch(vocab_size: int = 12):
    torch.manual_seed(0)
    logits = torch.randn(2, 5, vocab_size, dtype=torch.float64)
    labels = torch.tensor([[-100, -100, 3, 4, 1], [-100, 2, 5, 1, -100]])
    return logits, labels


def test_without_smoothing_it_is_the_causal_lm_cross_entropy() -> None:
    logits, labels = batch()
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 12), labels[:, 1:].reshape(-1),
                                                 ignore_index=-100)
    assert get_warmup_loss(logits, labels, vocab=12, smoothing=0.0).item() == pytest.approx(expected.item(), rel=1e-6)


def test_over_the_whole_vocabulary_it_is_torchs_label_smoothing() -> None:
    logits, labels = batch()
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 12), labels[:, 1:].reshape(-1),
                                                 ignore_index=-100, label_smoothing=0.2)
    assert get_warmup_loss(logits, labels, vocab=12, smoothing=0.2).item() == pytest.approx(expected.item(), rel=1e-6)


def test_spare_ids_get_no_smoothing_mass_and_are_pushed_down() -> None:
    logits, labels = batch()
    logits.requires_grad_(True)
    get_warmup_loss(logits, labels, vocab=8, smoothing=0.2).backward()
    learned = labels[:, 1:] != -100
    spare = logits.grad[:, :-1][learned][:, 8:]
    assert (spare > 0).all()  # only the softmax normaliser touches ids >= vocab: descent lowers their logits
    logp = torch.log_softmax(logits.detach()[:, :-1], -1)[learned]
    targets = labels[:, 1:][learned]
    manual = (0.8 * -logp.gather(-1, targets[:, None]).squeeze(-1) + 0.2 * -logp[:, :8].mean(-1)).mean()
    assert get_warmup_loss(logits.detach(), labels, vocab=8, smoothing=0.2).item() == pytest.approx(manual.item(), rel=1e-6)  # float32


@pytest.mark.parametrize("vocab", [0, 13])
def test_a_vocabulary_outside_the_logits_is_refused(vocab) -> None:
    logits, labels = batch()
    with pytest.raises(ValueError, match="vocab must be in 1..12"):
        get_warmup_loss(logits, labels, vocab=vocab)


def test_labels_with_nothing_to_learn_are_refused() -> None:
    logits, _ = batch()
    with pytest.raises(ValueError, match="no position to learn"):
        get_warmup_loss(logits, torch.full((2, 5), -100), vocab=12)
