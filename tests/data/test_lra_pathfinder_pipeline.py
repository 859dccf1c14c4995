"""Every Pathfinder image reaches a model with its own label and its full signal: the label read off the token
ids of each batch row (markers and curves, pathfinder_oracle) equals that row's target, in the Trainer's
shuffled batches and in the evaluation split; grey levels keep distinct ids apart from padding; the classifier
pools over the whole image."""

import numpy as np
import pytest
import torch

from linattn.data.lra import (
    PAD_ID,
    PIXEL_VOCAB,
    LRABatches,
    LRADataset,
    get_task,
    pathfinder_config,
    whole_split,
    write_pathfinder,
)
from linattn.data.lra.pathfinder_oracle import audit_pathfinder, image_label
from linattn.models import ModelConfig, PaddedClassifier, SequenceClassifier

DIFFICULTY = "curv_baseline"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("pathfinder")
    write_pathfinder(root, pathfinder_config(32, DIFFICULTY), DIFFICULTY, num_batches=2, batch_size=20, seed=4)
    return root


def _labels_read_off(inputs: torch.Tensor) -> list[int]:
    link = pathfinder_config(32, DIFFICULTY).link
    return [image_label((row.numpy() - PIXEL_VOCAB.offset).reshape(32, 32), link) for row in inputs]


def test_every_batch_row_keeps_its_label(data_dir):
    """The Trainer's batches permute images and labels together (an off-by-one or a separate shuffle of the
    labels would fail here); every row is a whole 32x32 image."""
    train = get_task("pathfinder32", data_dir, "train", difficulty=DIFFICULTY)
    batches = LRABatches(train, 8, seed=1)
    seen = []
    for index in range(2 * batches.per_epoch):  # two epochs: two permutations
        x, y = batches.batch(index)
        assert x.shape == (8, 1024) and y.shape == (8, 1)
        assert _labels_read_off(x) == y[:, 0].tolist()
        seen.append(y[:, 0])
    assert 0 < torch.cat(seen).float().mean() < 1, "both classes occur"
    for split in ("val", "test"):
        x, y = whole_split(get_task("pathfinder32", data_dir, split, difficulty=DIFFICULTY))
        assert _labels_read_off(x) == y[:, 0].tolist()


def test_audit_finds_wrong_labels(data_dir):
    """The audit is not blind: a data set with labels flipped at known places lists exactly those."""
    train = get_task("pathfinder32", data_dir, "train", difficulty=DIFFICULTY)
    link = pathfinder_config(32, DIFFICULTY).link
    assert audit_pathfinder(train, link) == []
    labels = train.labels.clone()
    labels[[2, 5]] = 1 - labels[[2, 5]]
    flipped = LRADataset(train.name, "train", train.vocab, 2, labels.tolist(),
                         seqs=[train.sequence(i).numpy() for i in range(len(train))])
    assert audit_pathfinder(flipped, link) == [2, 5]
    shifted = LRADataset(train.name, "train", train.vocab, 2, labels.roll(1).tolist(),
                         seqs=[train.sequence(i).numpy() for i in range(len(train))])
    assert audit_pathfinder(shifted, link), "labels one image off are caught"


def test_grey_levels_keep_distinct_ids_apart_from_specials():
    """Tokenisation loses nothing: the 256 grey levels map to 256 distinct ids, none of them padding, mask
    or unknown, and back."""
    ids = PIXEL_VOCAB.encode_values(np.arange(256))
    assert len(set(ids.tolist())) == 256 and min(ids.tolist()) > max(PAD_ID, PIXEL_VOCAB.mask_id, PIXEL_VOCAB.unk_id)
    assert np.array_equal(ids - PIXEL_VOCAB.offset, np.arange(256))
    with pytest.raises(ValueError, match="values"):
        PIXEL_VOCAB.encode_values(np.array([256]))


def test_classifier_pools_over_the_whole_image(data_dir):
    """Black pixels are not padding: the padded classifier's logits for a batch of images equal the plain
    classifier's pooled over all 1024 positions, and a change at the last pixel changes them."""
    x, _ = whole_split(get_task("pathfinder32", data_dir, "val", difficulty=DIFFICULTY))
    torch.manual_seed(0)
    inner = SequenceClassifier(ModelConfig(vocab_size=len(PIXEL_VOCAB), mixer="gla", d_model=16, n_layers=1,
                                           n_heads=2), 2, pooling="mean")
    clf = PaddedClassifier(inner, PAD_ID).eval()
    with torch.no_grad():
        got = clf(x)[:, 0]
        assert torch.allclose(got, inner(x), atol=1e-6)
        x2 = x.clone()
        x2[:, -1] = PIXEL_VOCAB.offset + 255 - (x2[:, -1] - PIXEL_VOCAB.offset)
        assert (clf(x2)[:, 0] - got).abs().max() > 1e-4
