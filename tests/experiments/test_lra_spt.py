"""Self-pretraining views (causal LM, masked denoising with the per-task mask ratios) and the weight
transfer to a classifier with the pretraining head dropped."""

import numpy as np
import pytest
import torch
from torch import nn

from linattn.data.base import IGNORE_INDEX
from linattn.data.lra import (
    LISTOPS_VOCAB,
    MASK_ID,
    MASK_RATIOS,
    PIXEL_VOCAB,
    CausalLMView,
    LRADataset,
    MaskedLMView,
    collate,
)
from linattn.models import load_pretrained


def toy(name="listops", n=4, pair=False, length=40):
    rng = np.random.default_rng(0)
    vocab = PIXEL_VOCAB if name in ("image", "pathfinder32", "pathx") else LISTOPS_VOCAB
    seqs = [rng.integers(3, len(vocab), length - i).astype(np.int16) for i in range(n)]
    seqs2 = [rng.integers(3, len(vocab), 7 + i).astype(np.int16) for i in range(n)] if pair else None
    return LRADataset(name, "train", vocab, 2, list(range(n)), seqs=seqs, seqs2=seqs2)


def test_causal_view():
    base = toy()
    view = CausalLMView(base)
    item = view[1]
    x = base[1]["input_ids"]
    assert torch.equal(item["input_ids"], x)
    assert torch.equal(item["labels"][:-1], x[1:]) and item["labels"][-1] == IGNORE_INDEX
    batch = collate([view[i] for i in range(len(view))])
    assert batch["labels"].shape == batch["input_ids"].shape and (batch["labels"][3, -4:] == IGNORE_INDEX).all()


def test_mask_ratios_of_the_paper():
    assert MASK_RATIOS == {"listops": 0.1, "text": 0.15, "retrieval": 0.15, "image": 0.5, "pathfinder32": 0.5,
                           "pathx": 0.5}


@pytest.mark.parametrize("name", ["listops", "image"])
def test_masked_view(name):
    base = toy(name, length=200)
    view = MaskedLMView(base, seed=1)
    for i in range(len(view)):
        x, item = base[i]["input_ids"], view[i]
        masked = item["input_ids"] == MASK_ID
        assert masked.sum().item() == round(MASK_RATIOS[name] * x.numel())
        assert torch.equal(item["labels"][masked], x[masked])  # loss on masked positions only
        assert (item["labels"][~masked] == IGNORE_INDEX).all() and torch.equal(item["input_ids"][~masked], x[~masked])
    assert torch.equal(view[0]["input_ids"], MaskedLMView(base, seed=1)[0]["input_ids"])  # deterministic
    view.set_epoch(1)
    assert not torch.equal(view[0]["input_ids"], MaskedLMView(base, seed=1)[0]["input_ids"])  # new masks


def test_pair_task_gives_every_document():
    base = toy("retrieval", n=3, pair=True)
    view = MaskedLMView(base, mask_ratio=0.5)
    assert len(view) == 6
    assert view[3]["labels"].numel() == base[1]["input_ids2"].numel()
    assert torch.equal(CausalLMView(base)[4]["input_ids"], base[2]["input_ids"])


def test_view_errors():
    with pytest.raises(ValueError, match="mask_ratio"):
        MaskedLMView(toy(), mask_ratio=1.5)
    with pytest.raises(ValueError, match="no default mask ratio"):
        MaskedLMView(toy("copy"))
    with pytest.raises(TypeError, match="LRADataset"):
        CausalLMView([1, 2])
    with pytest.raises(IndexError):
        CausalLMView(toy())[4]


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(18, 8)
        self.mix = nn.Linear(8, 8)


class LM(Backbone):
    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(8, 18)


class Classifier(Backbone):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 10)


def test_transfer_drops_the_pretraining_head():
    torch.manual_seed(0)
    lm, clf = LM(), Classifier()
    head_before = clf.head.weight.detach().clone()
    report = load_pretrained(clf, lm.state_dict())
    assert set(report.loaded) == {"embed.weight", "mix.weight", "mix.bias"}
    assert set(report.dropped) == {"lm_head.weight", "lm_head.bias"}
    assert set(report.kept) == {"head.weight", "head.bias"}
    assert torch.equal(clf.embed.weight, lm.embed.weight) and torch.equal(clf.mix.bias, lm.mix.bias)
    assert torch.equal(clf.head.weight, head_before)
    bad = dict(lm.state_dict(), **{"mix.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="mix.weight"):
        load_pretrained(clf, bad)
    assert "mix.weight" in load_pretrained(clf, bad, strict_shapes=False).dropped
    with pytest.raises(TypeError, match="model"):
        load_pretrained(lm.state_dict(), lm.state_dict())


def test_pretrain_then_finetune_on_generated_listops(tmp_path):
    """The whole data path of the SPT study on a tiny generated ListOps: masked pretraining of a toy
    model through a DataLoader, transfer without the LM head, a few classifier steps."""
    from torch.utils.data import DataLoader

    from linattn.data.lra import get_task, write_listops

    write_listops(tmp_path, num_train=48, num_val=8, num_test=8, min_length=10, max_length=40, max_depth=4,
                  max_args=4, seed=0)
    train = get_task("listops", tmp_path, "train")
    torch.manual_seed(0)

    class Toy(nn.Module):
        def __init__(self, out):
            super().__init__()
            self.embed = nn.Embedding(len(train.vocab), 16, padding_idx=0)
            self.mix = nn.Linear(16, 16)
            setattr(self, "lm_head" if out == "lm" else "head", nn.Linear(16, len(train.vocab) if out == "lm" else 10))

        def forward(self, ids):
            return torch.tanh(self.mix(self.embed(ids)))

    def step(model, loss, lr=0.5):  # plain SGD (torch.optim's import alone takes seconds)
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad

    lm = Toy("lm")
    spt = MaskedLMView(train)
    losses = []
    for epoch in range(3):
        spt.set_epoch(epoch)
        for batch in DataLoader(spt, batch_size=16, shuffle=True, collate_fn=collate):
            logits = lm.lm_head(lm(batch["input_ids"]))
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                               ignore_index=IGNORE_INDEX)
            step(lm, loss)
            losses.append(loss.item())
    assert np.isfinite(losses).all() and np.mean(losses[-3:]) < np.mean(losses[:3])

    clf = Toy("cls")
    report = load_pretrained(clf, lm.state_dict())
    assert "lm_head.weight" in report.dropped and "head.weight" in report.kept
    assert torch.equal(clf.embed.weight, lm.embed.weight)
    for batch in DataLoader(train, batch_size=16, shuffle=True, collate_fn=collate):
        h = clf(batch["input_ids"])
        keep = (batch["input_ids"] != 0).unsqueeze(-1)
        pooled = (h * keep).sum(1) / batch["lengths"].unsqueeze(-1)
        loss = nn.functional.cross_entropy(clf.head(pooled), batch["label"])
        step(clf, loss)
        assert torch.isfinite(loss)
