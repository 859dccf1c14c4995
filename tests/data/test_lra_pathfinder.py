"""Pathfinder generator and loader: the label equals a connectivity check on the drawn image (markers
found by erosion, curves linked across dash gaps), the release layout, splits and an exact round trip."""

import numpy as np
import pytest

from linattn.data.lra import DIFFICULTIES, PIXEL_VOCAB, draw_pathfinder, get_task, pathfinder_config, write_pathfinder
from linattn.data.lra.pathfinder_oracle import find_markers as markers
from linattn.data.lra.pathfinder_oracle import image_label
from linattn.data.lra.png import read_png


def connected(img, link):
    """Are the two markers of ``img`` on one curve? (lit pixels linked across gaps of <= ``link``)."""
    assert len(markers(img)) == 2, f"expected 2 markers, found {len(markers(img))}"
    return bool(image_label(img, link))


@pytest.mark.parametrize("difficulty", list(DIFFICULTIES))
def test_labels_match_connectivity_32(difficulty):
    cfg = pathfinder_config(32, difficulty)
    rng = np.random.default_rng(7)
    for i in range(6):
        img = draw_pathfinder(cfg, i % 2, rng)
        assert img.shape == (32, 32) and img.dtype == np.uint8 and set(np.unique(img)) <= {0, 255}
        assert connected(img, cfg.link) == bool(i % 2)


def test_labels_match_connectivity_pathx():
    cfg = pathfinder_config(128, "curv_contour_length_14")
    rng = np.random.default_rng(1)
    for label in (0, 1):
        img = draw_pathfinder(cfg, label, rng)
        assert img.shape == (128, 128)
        assert connected(img, cfg.link) == bool(label)


def test_check_sees_a_bridge():
    """The checker is not blind: joining the two markers of a negative image by a line makes it positive."""
    cfg = pathfinder_config(32, "curv_baseline")
    img = draw_pathfinder(cfg, 0, np.random.default_rng(0))
    assert not connected(img, cfg.link)
    (y0, x0), (y1, x1) = markers(img)
    for t in np.linspace(0, 1, 200):
        img[int(round(y0 + t * (y1 - y0))), int(round(x0 + t * (x1 - x0)))] = 255
    assert connected(img, cfg.link)


def test_curve_lengths_grow_with_difficulty():
    lit = {d: np.mean([(draw_pathfinder(pathfinder_config(32, d, num_distractors=0), 1, np.random.default_rng(s))
                        > 0).sum() for s in range(3)]) for d in DIFFICULTIES}
    assert lit["curv_baseline"] < lit["curv_contour_length_9"] < lit["curv_contour_length_14"]


def test_release_layout_and_round_trip(tmp_path):
    cfg = pathfinder_config(32, "curv_baseline")
    folder = write_pathfinder(tmp_path, cfg, "curv_baseline", num_batches=2, batch_size=5, seed=1)
    assert folder == tmp_path / "pathfinder32" / "curv_baseline"
    lines = (folder / "metadata" / "1.npy").read_text().splitlines()
    assert len(lines) == 5
    fields = lines[2].split()
    assert fields[:3] == ["imgs/1", "sample_2.png", "2"] and fields[3] in ("0", "1")
    assert (folder / "imgs" / "1" / "sample_2.png").is_file()
    items = [(b, line.split()) for b in (0, 1) for line in (folder / "metadata" / f"{b}.npy").read_text().splitlines()]
    sizes = {"train": 8, "val": 1, "test": 1}
    start = {"train": 0, "val": 8, "test": 9}
    for split, n in sizes.items():
        ds = get_task("pathfinder32", tmp_path, split, difficulty="curv_baseline")
        assert len(ds) == n and ds.num_classes == 2
        for i in range(n):
            b, f = items[start[split] + i]
            img = read_png(folder / f[0] / f[1])
            item = ds[i]
            assert item["input_ids"].shape == (1024,)
            assert np.array_equal(item["input_ids"].numpy() - PIXEL_VOCAB.offset, img.reshape(-1))
            assert item["label"].item() == int(f[3])
            assert connected(img, cfg.link) == bool(int(f[3]))


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="pathfinder128/curv_contour_length_14"):
        get_task("pathx", tmp_path, "train")
    with pytest.raises(ValueError, match="difficulty"):
        pathfinder_config(32, "hard")
    with pytest.raises(ValueError, match="size"):
        pathfinder_config(64)
    with pytest.raises(ValueError, match="label"):
        draw_pathfinder(pathfinder_config(32), 2, np.random.default_rng(0))
    with pytest.raises(RuntimeError, match="could not place"):
        draw_pathfinder(pathfinder_config(32, contour_length=60, max_tries=2), 1, np.random.default_rng(0))


@pytest.mark.slow
@pytest.mark.parametrize("size", [32, 128])
@pytest.mark.parametrize("difficulty", list(DIFFICULTIES))
def test_labels_match_connectivity_many(size, difficulty):
    cfg = pathfinder_config(size, difficulty)
    rng = np.random.default_rng(123)
    for i in range(60 if size == 32 else 16):
        assert connected(draw_pathfinder(cfg, i % 2, rng), cfg.link) == bool(i % 2)


def test_command_line(tmp_path):
    from linattn.data.lra.__main__ import main

    main(["pathfinder", "--out", str(tmp_path), "--difficulty", "curv_baseline", "--batches", "2",
          "--batch-size", "5"])
    folder = tmp_path / "pathfinder32" / "curv_baseline"
    assert sorted(p.name for p in (folder / "metadata").iterdir()) == ["0.npy", "1.npy"]
    again = write_pathfinder(tmp_path / "again", pathfinder_config(32, "curv_baseline"), "curv_baseline",
                             num_batches=1, batch_size=5, first_batch=1)
    assert (again / "metadata" / "1.npy").read_text() == (folder / "metadata" / "1.npy").read_text()
    assert np.array_equal(read_png(again / "imgs" / "1" / "sample_3.png"), read_png(folder / "imgs/1/sample_3.png"))


def test_dataset_pickles(tmp_path):
    """DataLoader workers started with spawn / forkserver need a picklable dataset."""
    import pickle

    write_pathfinder(tmp_path, pathfinder_config(32, "curv_baseline"), "curv_baseline", num_batches=1, batch_size=10)
    ds = get_task("pathfinder32", tmp_path, "train", difficulty="curv_baseline")
    again = pickle.loads(pickle.dumps(ds))
    assert np.array_equal(again[3]["input_ids"].numpy(), ds[3]["input_ids"].numpy())


def test_balanced_labels_and_look(tmp_path):
    """Half of each batch is positive, every label matches the drawn image, and the images keep the ink of
    the first (numpy) generator: 159 lit pixels on average at 32 px, contour length 14 (sd ~5)."""
    cfg = pathfinder_config(32, "curv_contour_length_14")
    folder = write_pathfinder(tmp_path, cfg, "curv_contour_length_14", num_batches=1, batch_size=12, seed=3)
    lines = [line.split() for line in (folder / "metadata" / "0.npy").read_text().splitlines()]
    labels = [int(f[3]) for f in lines]
    assert sum(labels) == 6
    imgs = [read_png(folder / f[0] / f[1]) for f in lines]
    assert [int(connected(img, cfg.link)) for img in imgs] == labels
    assert 140 < np.mean([(img > 0).sum() for img in imgs]) < 180


def test_deterministic_per_generator_state():
    cfg = pathfinder_config(32, "curv_baseline")
    a, b, c = np.random.default_rng(5), np.random.default_rng(5), np.random.default_rng(6)
    first = [draw_pathfinder(cfg, i % 2, a) for i in range(3)]
    assert all(np.array_equal(x, draw_pathfinder(cfg, i % 2, b)) for i, x in enumerate(first))
    assert not np.array_equal(first[0], draw_pathfinder(cfg, 0, c))
    with pytest.raises(TypeError, match="rng"):
        draw_pathfinder(cfg, 0, 5)


@pytest.mark.parametrize("size", [32, 128])
def test_canvas_grid_restored_after_each_curve(size):
    """Backing up (``truncate``) and lazily marked dashes leave no trace: after every curve, grown or not, the
    grid holds exactly BLOCK on the blocked cells and FREE elsewhere; the blocked cells cover the image's ink."""
    import random

    from linattn.data.lra.pathfinder_draw import BLOCK, FREE, Canvas

    cfg = pathfinder_config(size, "curv_contour_length_14")
    canvas, rnd = Canvas(cfg), random.Random(0)
    grown = []
    for n in (cfg.contour_length, cfg.contour_length) + (cfg.distractor_length,) * 12:
        grown.append(canvas.grow(n, rnd, start_marker=not grown, end_marker=not grown))
        assert canvas.grid == np.where(canvas.blocked, BLOCK, FREE).ravel().tolist()
    assert grown[0] and grown[1] and (size == 128 or not all(grown))  # at 32 px the failure path is taken too
    m = canvas.margin
    assert canvas.blocked[m: m + size, m: m + size][canvas.image > 0].all()


@pytest.mark.parametrize("size", [32, 128])
def test_curve_keeps_away_from_its_old_dashes(size, monkeypatch):
    """A dash stays more than ``link`` pixels (Chebyshev) from its curve's dashes ``exempt`` or more back."""
    import random

    from linattn.data.lra.pathfinder_draw import Canvas

    curves = []
    commit = Canvas.commit

    def record(self):
        W = self.width
        curves.append([np.array([divmod(p, W) for p in d]) for d in self.dashes])
        commit(self)

    monkeypatch.setattr(Canvas, "commit", record)
    cfg = pathfinder_config(size, "curv_contour_length_14", max_turn=90.0)  # sharp turns: curves would curl back
    rnd = random.Random(1)
    for _ in range(3):
        canvas = Canvas(cfg)
        assert canvas.grow(cfg.contour_length, rnd, start_marker=True, end_marker=True)
        assert canvas.grow(cfg.contour_length, rnd, start_marker=True)
    assert len(curves) == 6
    for dashes in curves:
        assert len(dashes) == cfg.contour_length
        for i in range(len(dashes)):
            for j in range(i + cfg.exempt, len(dashes)):
                gap = np.abs(dashes[i][:, None, :] - dashes[j][None, :, :]).max(-1).min()
                assert gap > cfg.link, (i, j, gap)
