"""Pathfinder's token cache: decoded once, memory-mapped after, keyed by the split's image list."""

import numpy as np
import pytest

from linattn.data.lra import get_task, image_cache, pathfinder_config, write_pathfinder
from linattn.data.lra.image_cache import CACHE_DIR


@pytest.fixture
def data(tmp_path):
    write_pathfinder(tmp_path, pathfinder_config(32, "curv_baseline"), "curv_baseline", num_batches=2, batch_size=10,
                     seed=2)
    return tmp_path


def _tokens(ds):
    return np.stack([ds[i]["input_ids"].numpy() for i in range(len(ds))])


def test_cached_tokens_equal_decoded_and_are_read_back(data, monkeypatch):
    plain = get_task("pathfinder32", data, "train", difficulty="curv_baseline", cache=False)
    cached = get_task("pathfinder32", data, "train", difficulty="curv_baseline")
    np.testing.assert_array_equal(_tokens(cached), _tokens(plain))
    assert cached.labels.tolist() == plain.labels.tolist()
    files = sorted((data / "pathfinder32" / "curv_baseline" / CACHE_DIR).glob("train-*.npy"))
    assert len(files) == 1

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded again although the cache file exists")

    monkeypatch.setattr(image_cache, "decode_tokens", no_decoding)
    again = get_task("pathfinder32", data, "train", difficulty="curv_baseline")
    assert isinstance(again.seqs, np.memmap)
    np.testing.assert_array_equal(_tokens(again), _tokens(plain))


def test_new_metadata_gets_a_new_cache_file(data):
    get_task("pathfinder32", data, "test", difficulty="curv_baseline")
    meta = data / "pathfinder32" / "curv_baseline" / "metadata" / "1.npy"
    lines = meta.read_text().splitlines()
    meta.write_text("\n".join(lines[:-2]) + "\n")  # two images fewer: the test split shifts
    ds = get_task("pathfinder32", data, "test", difficulty="curv_baseline")
    assert len(ds) == 2
    assert len(list((data / "pathfinder32" / "curv_baseline" / CACHE_DIR).glob("test-*.npy"))) == 2
    np.testing.assert_array_equal(
        _tokens(ds), _tokens(get_task("pathfinder32", data, "test", difficulty="curv_baseline", cache=False)))


def test_parallel_decoding_keeps_the_order(data, monkeypatch):
    plain = get_task("pathfinder32", data, "train", difficulty="curv_baseline", cache=False)
    monkeypatch.setattr(image_cache, "PARALLEL_FROM", 1)
    monkeypatch.setattr(image_cache, "CHUNK", 5)
    from functools import partial

    from linattn.data.lra.pathfinder import pixel_tokens
    out = image_cache.decode_tokens(partial(pixel_tokens, size=32), plain._load.paths, 1024, workers=2)
    np.testing.assert_array_equal(out, _tokens(plain))


def test_a_folder_that_cannot_be_written_decodes_without_a_file(data, monkeypatch):
    def read_only(*args, **kwargs):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(image_cache, "open", read_only, raising=False)
    ds = get_task("pathfinder32", data, "val", difficulty="curv_baseline")
    assert len(ds) == 2 and not isinstance(ds.seqs, np.memmap)
    assert not list((data / "pathfinder32" / "curv_baseline" / CACHE_DIR).glob("val-*.npy"))
