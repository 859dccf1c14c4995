"""The LRA self-pretraining study: run configs, batches, weight transfer, a tiny study end to end, report."""

from __future__ import annotations

import csv

import pytest
import torch

from linattn.data.lra import BYTE_VOCAB, PAD_ID, LRABatches, collate, get_task, whole_split, write_listops
from linattn.experiments import lra_run, run_study
from linattn.experiments.lra import PAPER_TRANSFORMER, conclusion, lra_report, lra_study, paper_table
from linattn.experiments.lra_curves import evaluate_checkpoints, run_curves
from linattn.experiments.lra_run import build_models, check_lra_config, train_lra_from_config
from linattn.experiments.report import Cell
from linattn.models import transfer_encoder
from linattn.train.checkpoint import load_checkpoint

TINY_LISTOPS = dict(num_train=64, num_val=24, num_test=24, min_length=4, max_length=24, max_depth=4, max_args=3)
TINY_TRAIN = {"max_steps": 6, "batch_size": 8, "warmup_steps": 2, "eval_every": 3, "log_every": 3,
              "eval_batch_size": 16}
TINY_MODEL = {"d_model": 16, "n_layers": 1, "n_heads": 2}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def listops_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lra")
    write_listops(root, **TINY_LISTOPS)
    return root


def _config(spt: str, data_dir, **task) -> dict:
    return {"kind": "lra",
            "task": {"name": "listops", "data_dir": str(data_dir), "spt": spt, "pretrain_steps": 3, **task},
            "model": {"mixer": "gla", **TINY_MODEL}, "train": {**TINY_TRAIN, "device": "cpu", "progress": False},
            "seed": 0}


@pytest.mark.parametrize("change, match", [
    ({"spt": "both"}, "task.spt"),
    ({"pretrain_steps": 6}, "pretrain_steps"),
    ({"pretrain_steps": 0}, "pretrain_steps"),
    ({"colour": 1}, "unknown LRA task key"),
    ({"name": "chess"}, "name must be one of"),
    ({"generate": 5}, "task.generate"),
    ({"val_examples": 0}, "task.val_examples"),
])
def test_bad_lra_configs(change, match, tmp_path):
    cfg = _config("causal", tmp_path)
    cfg["task"].update(change)
    with pytest.raises(ValueError, match=match):
        check_lra_config(cfg)


def test_bad_study_arguments():
    with pytest.raises(ValueError, match="mixers must be"):
        lra_study("smoke", mixers=["rnn"])
    with pytest.raises(ValueError, match="mixers must be"):
        lra_study("smoke", mixers=["gated_deltanet"])
    with pytest.raises(ValueError, match="spt must be"):
        lra_study("smoke", spt=[])
    with pytest.raises(ValueError, match="preset"):
        lra_study("huge")


def test_compute_matched_grid():
    study = lra_study("smoke")
    runs = study.runs()
    assert len(runs) == 3 * 3 * 2
    total = study.base["train"]["max_steps"]
    for r in runs:
        cfg = check_lra_config(r.config)
        assert cfg["train"]["max_steps"] == total
        assert cfg["task"]["pretrain_steps"] == (0 if cfg["task"]["spt"] == "none" else 200)
    full = lra_study("full", data_dir="/data/lra")
    assert {r.config["model"]["mixer"] for r in full.runs()} == {
        "softmax_attn", "gated_delta_rule", "delta_rule", "mamba2", "gla", "lru"}
    assert all(r.config["task"]["data_dir"] == "/data/lra" for r in full.runs())


def test_batches_are_deterministic_and_cover_an_epoch(listops_dir):
    train = get_task("listops", listops_dir, "train")
    a, b = LRABatches(train, 8, seed=3), LRABatches(train, 8, seed=3)
    x5, y5 = a.batch(5)
    assert torch.equal(x5, b.batch(5)[0]) and y5.shape == (8, 1)
    seen = torch.cat([a.batch(i)[1][:, 0] for i in range(8)])  # one epoch = 64 / 8 batches
    assert sorted(seen.tolist()) == sorted(train.labels.tolist())
    assert not torch.equal(a.batch(0)[0], a.batch(8)[0]), "a new epoch reshuffles"
    half = [LRABatches(train, 8, seed=3).batch(2, rank=r, world=2)[0] for r in range(2)]
    assert sum(h.shape[0] for h in half) == 8


def test_transfer_copies_the_encoder_and_keeps_the_head(listops_dir):
    cfg = check_lra_config(_config("causal", listops_dir))
    lm, clf = build_models(cfg, num_classes=10, vocab_size=18)
    head = clf.classifier.head.weight.detach().clone()
    names = transfer_encoder(lm, clf)
    lm_state, clf_state = lm.state_dict(), clf.classifier.state_dict()
    assert "embed.weight" in names and any(n.startswith("blocks.0.mixer") for n in names)
    assert all(torch.equal(clf_state[n], lm_state[n]) for n in names)
    assert set(clf_state) - set(names) == {"head.weight", "head.bias"}
    assert torch.equal(clf.classifier.head.weight, head)


@pytest.mark.parametrize("spt", ["causal", "masked"])
def test_fine_tuning_starts_from_the_pretrained_weights(spt, listops_dir, tmp_path, monkeypatch):
    starts = []

    class Recording(lra_run.Trainer):
        def fit(self, deadline=None):
            starts.append({k: v.detach().clone() for k, v in self.model.state_dict().items()})
            return super().fit(deadline)

    monkeypatch.setattr(lra_run, "Trainer", Recording)
    result = train_lra_from_config(_config(spt, listops_dir), tmp_path)
    assert result.status == "completed" and result.step == 6
    assert result.metrics["pretrain_steps"] == 3 and result.metrics["finetune_steps"] == 3
    pretrained = load_checkpoint(tmp_path / "pretrain" / "checkpoint.pt")["model"]
    lm_init, ft_start = starts
    encoder = [n for n in pretrained if not n.startswith("lm_head")]
    assert all(torch.equal(ft_start["classifier." + n], pretrained[n]) for n in encoder)
    assert not torch.equal(pretrained["embed.weight"], lm_init["embed.weight"]), "pretraining changed the weights"
    final = load_checkpoint(tmp_path / "finetune" / "checkpoint.pt")["model"]
    assert not torch.equal(final["classifier.embed.weight"], pretrained["embed.weight"]), "fine-tuning trained"


def test_tiny_study_end_to_end(tmp_path):
    study = lra_study("smoke", mixers=["softmax_attn"], seeds=[0], data_dir=tmp_path / "missing",
                      train=TINY_TRAIN, model=TINY_MODEL, task_options={"generate": TINY_LISTOPS, "pretrain_steps": 3})
    outcome = run_study(study, tmp_path / "out", workers=1, progress=False, write_report=lra_report)
    assert outcome.complete and outcome.finished == 3
    sdir = outcome.study_dir
    assert (sdir / "data" / "listops-1000" / "basic_train.tsv").is_file(), "ListOps generated into the study"
    with open(sdir / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["spt"] for r in rows) == ["causal", "masked", "none"]
    for r in rows:
        assert r["status"] == "finished" and r["step"] == "6" and 0.0 <= float(r["test_accuracy"]) <= 1.0
    report = (sdir / "report.md").read_text()
    assert "## Conclusion" in report and "causal SPT vs scratch" in report
    assert "## Against the paper" in report and "59.2" in report and "36.4" in report
    assert "![curves_listops](curves_listops.png)" in report and (sdir / "curves_listops.png").is_file()
    # every run's steps and time, with the device it ran on and how many runs shared it (one here)
    assert "## Runs" in report and "| listops | softmax_attn | causal | 0 | 3 | 3 |" in report
    assert all(r["device"] == "cpu" and r["runs_on_device"] == "1" for r in rows)
    # a finished run's checkpoint is its final model: scoring it again gives the run's own test accuracy
    scores = evaluate_checkpoints(sdir)  # the ListOps the study generated into its folder, found as the runs find it
    assert sorted(scores) == sorted(r["run_id"] for r in rows)
    for r in rows:
        assert scores[r["run_id"]]["finished"] and scores[r["run_id"]]["finetune_step"] == int(r["finetune_steps"])
        assert scores[r["run_id"]]["test_accuracy"] == float(r["test_accuracy"])
        assert scores[r["run_id"]]["test_loss"] == pytest.approx(float(r["test_loss"]), rel=1e-12)
    curves = run_curves(sdir / "runs" / rows[0]["run_id"])
    assert curves["val"] and all(step > (3 if curves["spt"] != "none" else 0) for step, _ in curves["val"])
    again = run_study(study, tmp_path / "out", workers=1, progress=False, write_report=lra_report,
                      study_dir=sdir)
    assert again.finished == 3, "finished runs are not rerun"


def _cell(mixer: str, spt: str, mean: float, std: float = 0.01) -> Cell:
    return Cell({"task": "listops", "mixer": mixer, "spt": spt}, 3e-3, mean, std, 2, {3e-3: mean})


def test_conclusion_and_paper_table_are_computed_from_the_numbers():
    study = lra_study("smoke")
    cells = [_cell("softmax_attn", "none", 0.30), _cell("softmax_attn", "causal", 0.50),
             _cell("softmax_attn", "masked", 0.31), _cell("gla", "none", 0.20), _cell("gla", "causal", 0.40),
             _cell("gla", "masked", 0.19)]
    text = conclusion(study, cells)
    assert ("causal SPT vs scratch**: mean gain +20.0 points over 2 mixer(s) (2 improved), beyond the seed noise: "
            "SPT helps (2.0)") in text
    assert "masked SPT vs scratch**: mean gain +0.0 points over 2 mixer(s) (1 improved), within the seed noise" in text
    worse = conclusion(study, [_cell("gla", "none", 0.40), _cell("gla", "causal", 0.20)])
    assert "mean gain -20.0 points over 1 mixer(s) (0 improved), beyond the seed noise: SPT hurts" in worse
    assert "Transformer 30.0 -> 50.0 here, 36.4 -> 59.2 in the paper" in text
    table = paper_table(study, cells)
    assert "| listops | none | 30.0 ± 1.0 | 36.4 |" in table and "| listops | causal | 50.0 ± 1.0 | 59.2 |" in table
    assert PAPER_TRANSFORMER["pathx"] == (None, 88.1)


def test_conclusion_gives_each_mixer_its_own_verdict_when_the_mean_hides_it():
    # the Transformer loses 6 points beyond its noise, gla gains 5 within its own wide noise: the mean says nothing
    cells = [_cell("softmax_attn", "none", 0.48, 0.005), _cell("softmax_attn", "causal", 0.42, 0.01),
             _cell("gla", "none", 0.40, 0.05), _cell("gla", "causal", 0.45, 0.03)]
    text = conclusion(lra_study("smoke"), cells)
    assert "mean gain -0.5 points over 2 mixer(s) (1 improved), within the seed noise" in text
    assert "  - softmax_attn: 48.0 -> 42.0, gain -6.0 points, beyond the seed noise: SPT hurts (2.2)." in text
    assert "  - gla: 40.0 -> 45.0, gain +5.0 points, within the seed noise: no clear effect (11.7)." in text
    alone = conclusion(lra_study("smoke"), cells[:2])
    assert "  - " not in alone, "one mixer: its line is the pooled one"


def test_cli_arguments_select_the_grid():
    import argparse

    from linattn.experiments.lra import lra_study_from_args

    args = argparse.Namespace(preset="smoke", tasks="listops", mixers="softmax_attn,gla", spt=["none", "causal"],
                              data_dir="/d")
    study = lra_study_from_args(args)
    assert list(study.axes["mixer"]) == ["softmax_attn", "gla"] and list(study.axes["spt"]) == ["none", "causal"]
    assert study.base["task"]["data_dir"] == "/d"
    plain = lra_study_from_args(argparse.Namespace(preset="smoke"))
    assert len(plain.runs()) == 18 and plain.base["task"]["data_dir"] is None
    assert list(lra_study("smoke", mixers=["gated_delta_rule"]).axes["mixer"]) == ["gated_delta_rule"]


def test_an_interrupted_run_resumes_to_the_same_end(listops_dir, tmp_path):
    import time

    cfg = _config("causal", listops_dir)
    first = train_lra_from_config(cfg, tmp_path / "a", deadline=time.time())
    assert first.status == "interrupted" and not (tmp_path / "a" / "result.json").exists()
    assert (tmp_path / "a" / "pretrain" / "checkpoint.pt").is_file()
    resumed = train_lra_from_config(cfg, tmp_path / "a")
    straight = train_lra_from_config(cfg, tmp_path / "b")
    assert resumed.step == straight.step == 6 and (tmp_path / "a" / "result.json").is_file()
    assert resumed.metrics["test_accuracy"] == pytest.approx(straight.metrics["test_accuracy"])
    assert resumed.metrics["test_loss"] == pytest.approx(straight.metrics["test_loss"], rel=1e-5)


# -- retrieval: document pairs ---------------------------------------------------------------------------
def _write_aan(root, n: int, seed: int, name: str) -> None:
    """A tiny AAN-format tsv (no header; label, id1, id2, text1, text2): label 1 when the documents share
    their first word. Some texts are Python bytes literals, as in the release."""
    g = torch.Generator().manual_seed(seed)
    words = ["graph", "parse", "tree", "lexicon", "neural", "corpus"]
    lines = []
    for i in range(n):
        a, b, c = (words[int(j)] for j in torch.randint(len(words), (3,), generator=g))
        label = i % 2
        second = a if label else next(w for w in words if w != a)
        t1, t2 = f"{a} {b} model {i}", f"{second} {c} data"
        if i % 3 == 0:
            t1 = repr(t1.encode())
        lines.append(f"{label}\tdoc{i}a\tdoc{i}b\t{t1}\t{t2}")
    (root / "tsv_data").mkdir(parents=True, exist_ok=True)
    (root / "tsv_data" / f"new_aan_pairs.{name}.tsv").write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def aan_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("aan")
    for name, n, seed in (("train", 32, 0), ("eval", 12, 1), ("test", 12, 2)):
        _write_aan(root, n, seed, name)
    return root


def _retrieval_config(spt: str, data_dir) -> dict:
    cfg = _config(spt, data_dir)
    cfg["task"]["name"] = "retrieval"
    return cfg


def test_pair_batches_stack_both_documents(aan_dir):
    train = get_task("retrieval", aan_dir, "train")
    x, y = LRABatches(train, 8, seed=0).batch(0)
    assert x.shape[:2] == (8, 2) and y.shape == (8, 1)
    x_all, y_all = whole_split(train)
    for i in range(len(train)):
        for j, key in enumerate(("input_ids", "input_ids2")):
            doc = train[i][key]
            assert torch.equal(x_all[i, j, :doc.numel()], doc)
            assert (x_all[i, j, doc.numel():] == PAD_ID).all()
    assert torch.equal(y_all[:, 0], train.labels)


def test_dual_classifier_reads_pairs_like_the_sequence_classifier(aan_dir):
    cfg = check_lra_config(_retrieval_config("causal", aan_dir))
    lm, clf = build_models(cfg, num_classes=2, vocab_size=len(BYTE_VOCAB), dual=True)
    assert clf.classifier.dual
    train = get_task("retrieval", aan_dir, "train")
    x, _ = whole_split(train)
    b = collate([train[i] for i in range(3)])
    want = clf.classifier(b["input_ids"], b["input_ids2"], mask=b["input_ids"] != PAD_ID,
                          mask2=b["input_ids2"] != PAD_ID)
    assert torch.allclose(clf(x[:3])[:, 0], want, atol=1e-5)
    with pytest.raises(ValueError, match=r"\[B, 2, T\]"):
        clf(x[:3, 0])
    names = transfer_encoder(lm, clf)
    assert "embed.weight" in names and not any(n.startswith("head") for n in names)


@pytest.mark.parametrize("spt", ["causal", "masked"])
def test_retrieval_run_pretrains_on_documents_then_fine_tunes_the_dual_encoder(spt, aan_dir, tmp_path,
                                                                               monkeypatch):
    starts, data = [], []

    class Recording(lra_run.Trainer):
        def fit(self, deadline=None):
            starts.append({k: v.detach().clone() for k, v in self.model.state_dict().items()})
            data.append(self.train_data.data)
            return super().fit(deadline)

    monkeypatch.setattr(lra_run, "Trainer", Recording)
    result = train_lra_from_config(_retrieval_config(spt, aan_dir), tmp_path)
    assert result.status == "completed" and result.step == 6
    assert 0.0 <= result.metrics["test_accuracy"] <= 1.0 and result.metrics["pretrain_loss"] is not None
    view, pairs = data
    assert len(view) == 2 * len(pairs) == 64, "each document of a pair is a pretraining sequence"
    if spt == "masked":
        assert view.mask_ratio == pytest.approx(0.15)
    pretrained = load_checkpoint(tmp_path / "pretrain" / "checkpoint.pt")["model"]
    lm_init, ft_start = starts
    assert ft_start["classifier.head.0.weight"].shape == (16, 4 * 16), "the dual encoder's head"
    encoder = [n for n in pretrained if not n.startswith("lm_head")]
    assert encoder and all(torch.equal(ft_start["classifier." + n], pretrained[n]) for n in encoder)
    assert not torch.equal(pretrained["embed.weight"], lm_init["embed.weight"]), "pretraining changed the weights"
    final = load_checkpoint(tmp_path / "finetune" / "checkpoint.pt")["model"]
    assert not torch.equal(final["classifier.embed.weight"], pretrained["embed.weight"]), "fine-tuning trained"


def test_tiny_retrieval_study_end_to_end(aan_dir, tmp_path):
    study = lra_study("smoke", tasks=["retrieval"], mixers=["softmax_attn"], spt=["none", "masked"], seeds=[0],
                      data_dir=aan_dir, train=TINY_TRAIN, model=TINY_MODEL, task_options={"pretrain_steps": 3})
    outcome = run_study(study, tmp_path / "out", workers=1, progress=False, write_report=lra_report)
    assert outcome.complete and outcome.finished == 2
    with open(outcome.study_dir / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["spt"] for r in rows) == ["masked", "none"]
    assert all(r["status"] == "finished" and r["step"] == "6" for r in rows)
    report = (outcome.study_dir / "report.md").read_text()
    assert "retrieval, masked SPT vs scratch" in report and "| retrieval | none |" in report and "57.5" in report


# -- the paper preset and the bidirectional classifier ---------------------------------------------------------
def test_paper_preset_grid_and_per_task_steps():
    study = lra_study("paper")
    assert list(study.axes["task"]) == ["listops", "pathfinder32"]
    assert list(study.axes["mixer"]) == ["softmax_attn", "gated_delta_rule", "gla"]
    assert list(study.axes["spt"]) == ["none", "causal", "masked"] and study.seeds == [0, 1, 2]
    runs = study.runs()
    assert len(runs) == 2 * 3 * 3 * 3
    # steps = epochs x training examples / batch 32: ListOps 96,000 -> 3,000 a epoch, 100 + 100 epochs;
    # Pathfinder-32 160,000 -> 5,000 a epoch, 50 SPT + 200 fine-tuning epochs
    expected = {"listops": (600_000, 300_000, 512, 6), "pathfinder32": (1_250_000, 250_000, 128, 4)}
    for r in runs:
        cfg = check_lra_config(r.config)
        total, pretrain, d, layers = expected[cfg["task"]["name"]]
        assert cfg["train"]["max_steps"] == total and cfg["train"]["batch_size"] == 32
        assert cfg["task"]["pretrain_steps"] == (0 if cfg["task"]["spt"] == "none" else pretrain)
        assert (cfg["model"]["d_model"], cfg["model"]["n_layers"]) == (d, layers)
        assert cfg["task"]["bidirectional"] is True and cfg["train"]["weight_decay"] == 0.0
    listops = next(r.config for r in runs if r.config["task"]["name"] == "listops")
    assert listops["task"]["generate"] == {}, "the LRA ListOps distribution, 96,000 training trees"
    # explicit overrides and --steps win over the per-task settings; other presets keep their single task
    small = lra_study("paper", tasks=["pathfinder32"], model={"d_model": 64}, steps={"pathfinder32": 100})
    cfg = small.runs()[0].config
    assert cfg["model"]["d_model"] == 64 and cfg["model"]["n_layers"] == 4 and cfg["train"]["max_steps"] == 100
    assert list(lra_study("h100").axes["task"]) == ["listops"]


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_bidirectional_must_be_a_bool(value, tmp_path):
    cfg = _config("causal", tmp_path, bidirectional=value)
    with pytest.raises(ValueError, match="task.bidirectional"):
        check_lra_config(cfg)
    assert check_lra_config(_config("none", tmp_path))["task"]["bidirectional"] is False


def test_transfer_into_the_bidirectional_classifier_copies_both_directions(listops_dir):
    cfg = check_lra_config(_config("masked", listops_dir, bidirectional=True))
    lm, clf = build_models(cfg, num_classes=10, vocab_size=18)
    assert clf.classifier.bidirectional
    names = transfer_encoder(lm, clf)
    lm_state, clf_state = lm.state_dict(), clf.classifier.state_dict()
    mixer = [n for n in lm_state if n.startswith("blocks.0.mixer.")]
    assert mixer
    for n in mixer:
        rest = n[len("blocks.0.mixer."):]
        for d in ("fwd", "bwd"):
            assert f"blocks.0.mixer.{d}.{rest}" in names
            assert torch.equal(clf_state[f"blocks.0.mixer.{d}.{rest}"], lm_state[n])
    assert torch.equal(clf_state["embed.weight"], lm_state["embed.weight"])
    assert set(clf_state) - set(names) == {"head.weight", "head.bias"}
    # copies, not shared storage: the two directions train apart
    fwd = clf.classifier.blocks[0].mixer.fwd
    bwd = clf.classifier.blocks[0].mixer.bwd
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(fwd.parameters(), bwd.parameters()))


@pytest.mark.parametrize("spt", ["none", "causal"])
def test_bidirectional_run_end_to_end(spt, listops_dir, tmp_path):
    result = train_lra_from_config(_config(spt, listops_dir, bidirectional=True), tmp_path)
    assert result.status == "completed" and result.step == 6
    assert 0.0 <= result.metrics["test_accuracy"] <= 1.0
    final = load_checkpoint(tmp_path / "finetune" / "checkpoint.pt")["model"]
    assert any(".mixer.bwd." in n for n in final)
    if spt == "causal":
        pretrained = load_checkpoint(tmp_path / "pretrain" / "checkpoint.pt")["model"]
        assert any(n.startswith("blocks.0.mixer.") for n in pretrained)


def test_val_examples_limit_the_evaluations_not_the_test(listops_dir, tmp_path, monkeypatch):
    seen = []
    real = lra_run.whole_split
    monkeypatch.setattr(lra_run, "whole_split", lambda data, limit=None: seen.append(
        (data.split, limit)) or real(data, limit))
    result = train_lra_from_config(_config("none", listops_dir, val_examples=7), tmp_path)
    assert result.status == "completed"
    assert seen == [("val", 7), ("test", None)]
    x, y = real(get_task("listops", listops_dir, "val"), 7)
    assert x.shape[0] == y.shape[0] == 7


def test_curves_command_names_a_folder_without_runs(tmp_path, capsys):
    from linattn.experiments.lra_curves import main

    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path)])
    assert exc.value.code == 2
    assert "has no runs/ folder (expected a folder made by 'linattn run lra')" in capsys.readouterr().err


def test_stopped_runs_are_listed_from_the_checkpoint_scores(tmp_path):
    import json

    from linattn.experiments.lra_curves import CHECKPOINT_SCORES, stopped_runs_table

    assert stopped_runs_table(tmp_path) == []
    (tmp_path / CHECKPOINT_SCORES).write_text(json.dumps({
        "run-a": {"finetune_step": 2431, "test_accuracy": 0.85714, "finished": False},
        "run-b": {"finetune_step": 2500, "test_accuracy": 0.9529, "finished": True}}))
    lines = stopped_runs_table(tmp_path)
    assert "| run-a | 2431 | 0.8571 |" in lines and not any("run-b" in line for line in lines)
