"""Loaders of the release's other tasks on small files written in their formats: Text (IMDB), Retrieval
(AAN tsv), Image (CIFAR-10 pickles); collate; the registry; missing-data errors."""

import csv
import pickle

import numpy as np
import pytest
import torch

from linattn.data.base import IGNORE_INDEX
from linattn.data.lra import BYTE_VOCAB, PIXEL_VOCAB, TASKS, collate, get_task, list_lra_tasks, task_info


def write_imdb(root, reviews):
    for split, items in reviews.items():
        for i, (label, text) in enumerate(items):
            d = root / "aclImdb" / split / ("pos" if label else "neg")
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{i}_{7 if label else 2}.txt").write_bytes(text.encode("utf-8"))


def test_text(tmp_path):
    long = "x" * 5000
    write_imdb(tmp_path, {"train": [(1, "Great film!"), (0, "Dull <br />plot. é"), (1, long)],
                          "test": [(0, "Bad."), (1, "Good.")]})
    ds = get_task("text", tmp_path, "train")
    assert len(ds) == 3 and ds.num_classes == 2 and ds.vocab is BYTE_VOCAB
    texts = {bytes((ds[i]["input_ids"] - BYTE_VOCAB.offset).tolist()): ds[i]["label"].item() for i in range(3)}
    assert texts[b"Great film!"] == 1
    assert texts["Dull <br />plot. é".encode()] == 0  # bytes, not characters: é is two tokens
    assert texts[b"x" * 4096] == 1  # cut at 4096
    for split in ("val", "test"):
        t = get_task("text", tmp_path, split)
        assert len(t) == 2 and bytes((t[0]["input_ids"] - 3).tolist()) == b"Bad." and t[0]["label"] == 0
        assert bytes((t[1]["input_ids"] - 3).tolist()) == b"Good." and t[1]["label"] == 1
    with pytest.raises(FileNotFoundError, match="aclImdb"):
        get_task("text", tmp_path / "nothing", "train")


def write_aan(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f, delimiter="\t", lineterminator="\n").writerows(rows)


def test_retrieval(tmp_path):
    doc = "y" * 4500
    write_aan(tmp_path / "tsv_data" / "new_aan_pairs.train.tsv",
              [["1", "P1", "P2", repr(b"Neural nets\n\xc3\xa9"), "plain second"], ["0.0", "P3", "P4", "a", doc]])
    write_aan(tmp_path / "tsv_data" / "new_aan_pairs.eval.tsv", [["0", "P5", "P6", "c", "d"]])
    ds = get_task("retrieval", tmp_path, "train")
    assert len(ds) == 2 and ds.is_pair and task_info("retrieval").pair
    first = ds[0]
    assert bytes((first["input_ids"] - 3).tolist()) == b"Neural nets\n\xc3\xa9"  # bytes literal decoded
    assert bytes((first["input_ids2"] - 3).tolist()) == b"plain second"
    assert first["label"] == 1 and ds[1]["label"] == 0
    assert ds[1]["input_ids2"].numel() == 4000
    val = get_task("retrieval", tmp_path, "val")
    assert len(val) == 1 and bytes((val[0]["input_ids"] - 3).tolist()) == b"c"
    with pytest.raises(FileNotFoundError, match="new_aan_pairs.test.tsv"):
        get_task("retrieval", tmp_path, "test")
    write_aan(tmp_path / "tsv_data" / "new_aan_pairs.test.tsv", [["1", "a", "b", "c"]])
    with pytest.raises(ValueError, match="5 tab-separated"):
        get_task("retrieval", tmp_path, "test")


def write_cifar(folder, rng, n_train=4, n_test=3):
    folder.mkdir(parents=True)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        n = n_test if name == "test_batch" else n_train
        d = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"labels": rng.integers(0, 10, n).tolist()}
        with open(folder / name, "wb") as f:
            pickle.dump(d, f)
        batches[name] = d
    return batches


def test_image(tmp_path):
    batches = write_cifar(tmp_path / "cifar-10-batches-py", np.random.default_rng(0))
    train_rows = np.concatenate([batches[f"data_batch_{i}"][b"data"] for i in range(1, 6)])
    train_labels = sum((batches[f"data_batch_{i}"][b"labels"] for i in range(1, 6)), [])
    ds = {s: get_task("image", tmp_path, s) for s in ("train", "val", "test")}
    assert (len(ds["train"]), len(ds["val"]), len(ds["test"])) == (18, 2, 3)
    assert ds["train"].vocab is PIXEL_VOCAB and ds["train"].num_classes == 10
    # val image 1 is training image 19; grey levels as tf.image.rgb_to_grayscale, by hand in float64
    rgb = train_rows[19].reshape(3, 1024).astype(float)
    grey = np.floor((0.2989 * rgb[0] + 0.5870 * rgb[1] + 0.1140 * rgb[2]) / 255 * 255.5).astype(int)
    item = ds["val"][1]
    assert item["input_ids"].shape == (1024,) and item["input_ids"].tolist() == (grey + 3).tolist()
    assert item["input_ids"].reshape(32, 32)[5, 7] == grey[5 * 32 + 7] + 3  # row-major: row 5, column 7
    assert item["label"].item() == train_labels[19]
    assert ds["test"][2]["label"].item() == batches["test_batch"][b"labels"][2]
    (tmp_path / "cifar-10-batches-py" / "test_batch").unlink()
    with pytest.raises(FileNotFoundError, match="test_batch"):
        get_task("image", tmp_path, "test")


def test_collate():
    items = [{"input_ids": torch.tensor([5, 6, 7]), "label": torch.tensor(1)},
             {"input_ids": torch.tensor([8]), "label": torch.tensor(0)}]
    b = collate(items)
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert b["lengths"].tolist() == [3, 1] and b["label"].tolist() == [1, 0]
    assert collate(items, pad_to=5)["input_ids"].shape == (2, 5)
    with pytest.raises(ValueError, match="pad_to"):
        collate(items, pad_to=2)
    pairs = [{"input_ids": torch.tensor([4]), "input_ids2": torch.tensor([4, 5]), "labels": torch.tensor([9])},
             {"input_ids": torch.tensor([4, 4]), "input_ids2": torch.tensor([6]), "labels": torch.tensor([1, 2])}]
    b = collate(pairs)
    assert b["input_ids2"].tolist() == [[4, 5], [6, 0]] and b["lengths2"].tolist() == [2, 1]
    assert b["labels"].tolist() == [[9, IGNORE_INDEX], [1, 2]]
    with pytest.raises(ValueError, match="non-empty"):
        collate([])


def test_registry():
    assert list_lra_tasks() == ["listops", "text", "retrieval", "image", "pathfinder32", "pathx"]
    assert {n: TASKS[n].max_len for n in TASKS} == {"listops": 2000, "text": 4096, "retrieval": 4000,
                                                     "image": 1024, "pathfinder32": 1024, "pathx": 16384}
    assert [len(TASKS[n].vocab) for n in ("listops", "text", "image")] == [18, 259, 259]
    with pytest.raises(ValueError, match="name must be one of"):
        get_task("cifar", ".", "train")
    with pytest.raises(TypeError, match="data_dir"):
        get_task("image", 3, "train")


def test_vocab_and_dataset_checks():
    from linattn.data.lra import LISTOPS_VOCAB, LRADataset, Vocab

    assert LISTOPS_VOCAB.encode(["[MAX", "7", "]", "?"]).tolist() == [14, 10, 17, 2]  # "?" is <unk>
    assert LISTOPS_VOCAB.decode([0, 1, 2, 3]) == ["<pad>", "<mask>", "<unk>", "0"]
    assert BYTE_VOCAB.encode_values(np.array([0, 255])).tolist() == [3, 258]
    with pytest.raises(ValueError, match="values for vocabulary 'pixels'"):
        PIXEL_VOCAB.encode_values(np.array([256]))
    with pytest.raises(ValueError, match="distinct"):
        Vocab(["a", "a"], "dup")
    seqs = [np.array([3, 4], np.int16)]
    with pytest.raises(ValueError, match="exactly one of seqs or load"):
        LRADataset("x", "train", BYTE_VOCAB, 2, [0])
    with pytest.raises(ValueError, match="seqs2 has 2 sequences"):
        LRADataset("x", "train", BYTE_VOCAB, 2, [0], seqs=seqs, seqs2=seqs * 2)
    ds = LRADataset("x", "train", BYTE_VOCAB, 2, [1], seqs=seqs)
    assert ds[0]["input_ids"].dtype == torch.int64 and ds[-1]["label"] == 1
    with pytest.raises(IndexError):
        ds[1]
    with pytest.raises(ValueError, match="second=True"):
        ds.sequence(0, second=True)
    with pytest.raises(ValueError, match="max_len"):
        get_task("text", ".", "train", max_len=0)
