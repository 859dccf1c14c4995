"""Named errors of the LRA loaders: labels outside a task's classes or not numbers (file and line), data sets
without examples, empty or corrupt CIFAR batches, and out-of-range counts on the data command line."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from test_lra_loaders import write_aan, write_cifar

from linattn.data.lra import get_task
from linattn.data.lra.__main__ import main as data_main
from linattn.errors import DataError, MissingFileError

DIFFICULTY = "curv_contour_length_14"


def _listops(root, rows) -> str:
    path = root / "listops-1000" / "basic_train.tsv"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("Source\tTarget\n" + "".join(f"{src}\t{label}\n" for src, label in rows))
    return str(path)


@pytest.mark.parametrize("label, line", [("12", 3), ("x", 3), ("-1", 3), ("2.5", 3)])
def test_listops_label_outside_the_classes(tmp_path, label, line):
    path = _listops(tmp_path, [("( [MAX 2 3 ] )", "3"), ("( [MIN 4 5 ] )", label)])
    with pytest.raises(DataError, match=rf"{path}, line {line}: label must be an integer in \[0, 10\) "
                                        rf"\(the task's classes\), got '{label}'"):
        get_task("listops", tmp_path, "train")


def test_listops_header_only_is_refused(tmp_path):
    path = _listops(tmp_path, [])
    with pytest.raises(DataError, match=rf"{path}: no examples after the header"):
        get_task("listops", tmp_path, "train")


def _aan(root, rows):
    path = root / "tsv_data" / "new_aan_pairs.train.tsv"
    write_aan(path, rows)
    return str(path)


def test_retrieval_labels(tmp_path):
    path = _aan(tmp_path, [["label", "id1", "id2", "text1", "text2"], ["1.0", "a", "b", "c", "d"],
                           ["5", "a", "b", "c", "d"]])
    with pytest.raises(DataError, match=rf"{path}, line 3: label must be an integer in \[0, 2\) .*got '5'"):
        get_task("retrieval", tmp_path, "train")
    _aan(tmp_path, [["1.0", "a", "b", "c", "d"], ["x", "a", "b", "c", "d"]])
    with pytest.raises(DataError, match=r"line 2: label must be an integer in \[0, 2\) .*got 'x'"):
        get_task("retrieval", tmp_path, "train")
    _aan(tmp_path, [["1.0", "a", "b", "c", "d"], ["0", "e", "f", "g", "h"]])
    assert get_task("retrieval", tmp_path, "train").labels.tolist() == [1, 0]


def test_retrieval_header_only_is_refused(tmp_path):
    path = _aan(tmp_path, [["label", "id1", "id2", "text1", "text2"]])
    with pytest.raises(DataError, match=rf"{path}: no document pairs \(the file is empty or a header alone\)"):
        get_task("retrieval", tmp_path, "train")


def _metadata(root, lines):
    meta = root / "pathfinder32" / DIFFICULTY / "metadata" / "0.npy"
    meta.parent.mkdir(parents=True, exist_ok=True)
    meta.write_text("".join(f"{line}\n" for line in lines))
    return str(meta)


def test_pathfinder_labels(tmp_path):
    meta = _metadata(tmp_path, [f"imgs/0 sample_{i}.png {i} {i % 2}" for i in range(9)] + ["imgs/0 s.png 9 7"])
    with pytest.raises(DataError, match=rf"{meta}, line 10: label must be an integer in \[0, 2\) .*got '7'"):
        get_task("pathfinder32", tmp_path, "train")
    _metadata(tmp_path, ["imgs/0 sample_0.png 0 x"])
    with pytest.raises(DataError, match=r"0\.npy, line 1: label must be an integer in \[0, 2\) .*got 'x'"):
        get_task("pathfinder32", tmp_path, "train")


def test_pathfinder_empty_metadata_and_empty_split(tmp_path):
    _metadata(tmp_path, [])
    with pytest.raises(DataError, match=r"metadata/\*\.npy: no image listed"):
        get_task("pathfinder32", tmp_path, "train")
    _metadata(tmp_path, ["imgs/0 sample_0.png 0 1", "imgs/0 sample_1.png 1 0"])
    assert len(get_task("pathfinder32", tmp_path, "train", cache=False)) == 2
    with pytest.raises(DataError, match=r"imgs/0/sample_0.png: image listed in the metadata is missing"):
        get_task("pathfinder32", tmp_path, "train")  # the cache decodes every image up front
    with pytest.raises(DataError, match=r"no image in split 'val' \(2 listed; val takes 10% of them\)"):
        get_task("pathfinder32", tmp_path, "val")


@pytest.mark.parametrize("content, match", [
    (b"", r"test_batch: empty file, expected a CIFAR-10 python batch"),
    (b"\x80\x04garbage", r"test_batch: not a CIFAR-10 python batch, unpickling failed"),
    (pickle.dumps({b"labels": [1]}), r"test_batch: a CIFAR-10 python batch is a dict with b'data' and b'labels'"),
    (pickle.dumps({b"data": np.zeros((0, 3072), np.uint8), b"labels": []}), r"test_batch: no images"),
    (pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [3]}), r"labels must be 2 integers"),
    (pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [3, 11]}),
     r"test_batch: label must be an integer in \[0, 10\) .*got 11 at item 1"),
])
def test_cifar_batch_errors(tmp_path, content, match):
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar(folder, np.random.default_rng(0))
    (folder / "test_batch").write_bytes(content)
    with pytest.raises(DataError, match=match):
        get_task("image", tmp_path, "test")


def test_missing_data_is_a_missing_file_error(tmp_path):
    with pytest.raises(MissingFileError, match="listops-1000/basic_train.tsv"):
        get_task("listops", tmp_path, "train")
    (tmp_path / "aclImdb" / "train" / "pos").mkdir(parents=True)
    (tmp_path / "aclImdb" / "train" / "neg").mkdir(parents=True)
    with pytest.raises(MissingFileError, match=r"no \*\.txt reviews"):
        get_task("text", tmp_path, "train")


@pytest.mark.parametrize("argv, flag", [
    (["pathfinder", "--batches", "0"], "--batches"),
    (["pathfinder", "--batch-size", "-3"], "--batch-size"),
    (["pathfinder", "--workers", "0"], "--workers"),
    (["listops", "--num-train", "0"], "--num-train"),
    (["listops", "--seed", "x"], "--seed"),
])
def test_data_command_line_refuses_out_of_range_counts(tmp_path, capsys, argv, flag):
    with pytest.raises(SystemExit) as info:
        data_main([argv[0], "--out", str(tmp_path / "out"), *argv[1:]])
    assert info.value.code == 2
    assert f"argument {flag}: expected an int >= " in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
