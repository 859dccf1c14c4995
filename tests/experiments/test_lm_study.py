"""The language-modelling study: run configs of kind lm, the grid of its presets, a tiny study end to end."""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import pytest

from linattn.experiments import run_study
from linattn.experiments.lm import EXCLUDE, MIXERS, lm_report, lm_study
from linattn.experiments.lm_run import check_lm_config
from linattn.experiments.registry import get_study
from linattn.experiments.runs import train_run
from linattn.experiments.study import Study

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from text_fixtures import write_corpus  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_TRAIN = {"max_steps": 4, "batch_size": 4, "warmup_steps": 1, "eval_every": 2, "log_every": 2,
              "eval_batch_size": 8, "target_metric": "loss", "device": "cpu", "progress": False}


def _config(root: Path, cache: Path, **task) -> dict:
    return {"kind": "lm",
            "task": {"name": "text", "root": str(root), "include": ["*.txt"], "val_fraction": 0.2,
                     "test_fraction": 0.2, "seq_len": 16, "eval_windows": 4, "test_windows": 4,
                     "cache_dir": str(cache), **task},
            "model": {"mixer": "gated_delta_rule", "d_model": 16, "n_layers": 1, "n_heads": 2},
            "train": dict(TINY_TRAIN), "seed": 0}


@pytest.mark.parametrize("change, match", [
    ({"tokenizer": "words"}, "task.tokenizer"),
    ({"tokenizer": "bpe"}, "task.vocab_size"),
    ({"vocab_size": 300}, "null for the bytes tokenizer"),
    ({"seq_len": 0}, "task.seq_len"),
    ({"include": "*.txt"}, "task.include"),
    ({"colour": 1}, "unknown lm task key"),
    ({"pack_documents": "yes"}, "task.pack_documents"),
])
def test_bad_lm_configs(change, match, tmp_path):
    cfg = _config(tmp_path, tmp_path)
    cfg["task"].update(change)
    with pytest.raises(ValueError, match=match):
        check_lm_config(cfg)


def test_grid_of_the_presets():
    smoke = lm_study("smoke")
    labels = [dict(s) for s in smoke.settings()]
    assert {"mixer": "softmax_attn", "conv": "none", "kv": "separate"} in labels
    assert {"mixer": "gated_delta_rule", "conv": "k", "kv": "exact"} in labels
    assert not any(d["conv"] == "qkv" and d["kv"] == "exact" for d in labels)
    assert len(smoke.runs()) == 12 and smoke.seeds == [0, 1]
    full = lm_study("full")
    assert set(full.axes["mixer"]) == set(MIXERS) and set(full.axes["conv"]) == {"none", "k", "qkv", "shift-k"}
    assert len(full.seeds) >= 3
    settings = [dict(s) for s in full.settings()]
    # every combination but mamba2 with K = V and qkv with K = V (a conv on v is the conv on k there)
    assert len(settings) == 7 * 4 * 2 - 4 - 6
    assert not any(all(d[k] == v for k, v in e.items()) for d in settings for e in EXCLUDE)
    exact = next(s for s in full.runs() if dict(s.labels) == {"mixer": "mesa_net", "conv": "shift-k", "kv": "exact"})
    kw = exact.config["model"]["mixer_kwargs"]
    assert kw == {"short_conv": "k", "conv_mode": "shift", "tie_kv": "exact", "solver": "cg", "cg_steps": 16}
    none = next(s for s in full.runs() if dict(s.labels) == {"mixer": "gla", "conv": "none", "kv": "separate"})
    assert none.config["model"]["mixer_kwargs"]["short_conv"] == ""
    assert get_study("lm", "full")[0].fingerprint() == full.fingerprint()


def test_one_run_scores_bits_per_byte(tmp_path):
    root = write_corpus(tmp_path / "corpus")
    result = train_run(_config(root, tmp_path / "cache"), tmp_path / "run")
    m = result.metrics
    assert result.status == "completed" and result.step == 4
    assert math.isfinite(m["test_bpb"]) and m["val_bpb"] == pytest.approx(m["val_loss"] * m["val_bpb_per_nat"])
    assert 0 < m["unigram_bpb"] < 8 and m["vocab_size"] == 256
    # the shards were built once in the cache folder, and a rerun resumes from the finished checkpoint
    assert len([p for p in (tmp_path / "cache").iterdir() if p.is_dir()]) == 1
    again = train_run(_config(root, tmp_path / "cache"), tmp_path / "run")
    assert again.metrics["test_bpb"] == pytest.approx(m["test_bpb"])


def test_a_run_on_packed_documents(tmp_path, monkeypatch):
    """task.pack_documents: the trainer's batches are whole documents packed with cu_seqlens, batch_size * seq_len
    tokens each, and the model sees the offsets."""
    from linattn.models import CausalLM

    seen = []
    forward = CausalLM.forward

    def spy(self, input_ids, *args, **kwargs):
        if self.training:
            seen.append((tuple(input_ids.shape), kwargs.get("cu_seqlens")))
        return forward(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(CausalLM, "forward", spy)
    root = write_corpus(tmp_path / "corpus")
    result = train_run(_config(root, tmp_path / "cache", pack_documents=True), tmp_path / "run")
    assert result.status == "completed" and result.step == 4 and math.isfinite(result.metrics["test_bpb"])
    assert len(seen) == 4 and all(shape == (1, 4 * 16) and cu is not None and int(cu[-1]) == 64 for shape, cu in seen)


def test_tiny_study_end_to_end(tmp_path):
    root = write_corpus(tmp_path / "corpus")
    smoke = lm_study("smoke").to_dict()
    smoke["base"] = _config(root, tmp_path / "cache")
    smoke["seeds"] = [0]
    smoke["axes"] = {"mixer": {"gated_delta_rule": {"model.mixer": "gated_delta_rule"}},
                     "conv": {k: v for k, v in smoke["axes"]["conv"].items() if k in ("none", "qkv")},
                     "kv": smoke["axes"]["kv"]}
    smoke["exclude"] = [{"conv": "qkv", "kv": "exact"}]
    study = Study.from_dict(smoke)
    out = run_study(study, tmp_path / "runs", workers=1, progress=False, write_report=lm_report)
    assert out.complete and out.finished == len(study.settings()) == 3
    report = (out.study_dir / "report.md").read_text()
    assert "## Conclusion" in report and "unigram entropy of the training split" in report
    assert "removing the conv" in report and "exact K = V" in report
    assert (out.study_dir / "curves.png").is_file()
    rows = list(csv.DictReader(open(out.study_dir / "results.csv")))
    assert {r["kv"] for r in rows} == {"separate", "exact"} and all(math.isfinite(float(r["test_bpb"])) for r in rows)
    curves = (out.study_dir / "curves.csv").read_text().splitlines()
    assert curves[0] == "setting,step,val_bpb" and any(",4," in line for line in curves[1:])


def test_full_preset_models_within_ten_percent_of_each_other():
    from linattn.models import CausalLM, ModelConfig

    counts = {}
    for spec in lm_study("full").runs():
        labels = dict(spec.labels)
        if spec.seed != 0 or labels["conv"] != "qkv":
            continue
        model = spec.config["model"]
        cfg = ModelConfig.from_dict({"vocab_size": spec.config["task"]["vocab_size"], **model})
        counts[labels["mixer"]] = sum(p.numel() for p in CausalLM(cfg).parameters())
    assert set(counts) == set(MIXERS)
    assert max(counts.values()) / min(counts.values()) <= 1.1, counts


def test_existing_presets_keep_their_fingerprints():
    """The smoke and full presets are the studies already run: adding presets must not change them."""
    assert lm_study("smoke").fingerprint() == "bbbd5ef03c61a983"
    assert lm_study("full").fingerprint() == "0b8b5fb7c324bcf7"


def test_full_docs_preset_is_full_on_the_stdlib_and_docs_corpus(tmp_path, monkeypatch):
    from linattn.experiments.lm import DEFAULT_DOCS_DIR, DOCS_ENV, PRESETS

    monkeypatch.delenv(DOCS_ENV, raising=False)
    full, docs = lm_study("full"), lm_study("full-docs", str(tmp_path))
    assert docs.axes == full.axes and docs.exclude == full.exclude and docs.seeds == full.seeds
    assert docs.lrs == full.lrs and len(docs.runs()) == len(full.runs()) == 138
    task = docs.base["task"]
    assert task["sources"] == [{"name": "stdlib", "root": None, "include": None, "exclude": None},
                               {"name": "docs", "root": str(tmp_path), "include": ["*.rst.txt"], "exclude": None}]
    assert {k: v for k, v in task.items() if k != "sources"} == full.base["task"]
    assert {k: v for k, v in docs.base.items() if k != "task"} == {k: v for k, v in full.base.items() if k != "task"}
    assert "sources" not in PRESETS["full"]["base"]["task"]  # full's base is not touched
    assert lm_study("full-docs").base["task"]["sources"][1]["root"] == DEFAULT_DOCS_DIR
    monkeypatch.setenv(DOCS_ENV, str(tmp_path / "env"))
    assert lm_study("full-docs").base["task"]["sources"][1]["root"] == str(tmp_path / "env")
    with pytest.raises(ValueError, match="--corpus-root"):
        lm_study("full", str(tmp_path))


def test_full_docs_missing_folder_names_the_flag_and_the_command(tmp_path, capsys, monkeypatch):
    from linattn import cli
    from linattn.experiments.lm import DOCS_ENV

    monkeypatch.delenv(DOCS_ENV, raising=False)
    missing = tmp_path / "python-docs"
    for folder, why in ((missing, "does not exist"), (tmp_path, "has no *.rst.txt file")):
        assert cli.main(["run", "lm", "--preset", "full-docs", "--corpus-root", str(folder),
                         "--out", str(tmp_path / "runs")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("linattn: error: --corpus-root:") and why in err and "\n" not in err
        assert f"python -m linattn.data.text python-docs --out {folder}" in err
    assert not (tmp_path / "runs").exists()
    assert cli.main(["run", "shortconv", "--corpus-root", str(tmp_path), "--out", str(tmp_path / "runs")]) == 2
    assert "is an option of study 'lm'" in capsys.readouterr().err


def test_full_docs_study_from_args_resolves_the_folder(tmp_path, monkeypatch):
    import argparse

    from linattn.experiments.lm import LM_STUDY

    (tmp_path / "docs" / "library").mkdir(parents=True)
    (tmp_path / "docs" / "library" / "json.rst.txt").write_text("json\n====\n")
    monkeypatch.chdir(tmp_path)
    study = LM_STUDY.study_from_args(argparse.Namespace(preset="full-docs", corpus_root="docs"), workers=1)
    assert study.base["task"]["sources"][1]["root"] == str(tmp_path / "docs")  # absolute: runs start anywhere
    plain = LM_STUDY.study_from_args(argparse.Namespace(preset="full", corpus_root=None), workers=1)
    assert plain.fingerprint() == lm_study("full").fingerprint()


@pytest.mark.parametrize("change, match", [
    ({"sources": []}, "task.sources"),
    ({"sources": [{"root": "x"}]}, "task.sources\\[0\\]"),
    ({"sources": [{"name": "a/b"}]}, "task.sources\\[0\\].name"),
    ({"sources": [{"name": "a"}, {"name": "a"}]}, "task.sources\\[1\\].name"),
    ({"sources": [{"name": "a", "include": "*.txt"}]}, "task.sources\\[0\\].include"),
])
def test_bad_sources_configs(change, match, tmp_path):
    cfg = _config(tmp_path, tmp_path)
    cfg["task"].update(change, root=None, include=None)
    with pytest.raises(ValueError, match=match):
        check_lm_config(cfg)
    cfg["task"].update(sources=[{"name": "a", "root": str(tmp_path)}], root=str(tmp_path))
    with pytest.raises(ValueError, match="task.root: expected null when task.sources is given"):
        check_lm_config(cfg)


def test_configs_without_sources_are_normalised_as_before(tmp_path):
    assert "sources" not in check_lm_config(_config(tmp_path, tmp_path))["task"]


def test_one_run_on_two_sources(tmp_path):
    write_corpus(tmp_path / "a")
    write_corpus(tmp_path / "b", n_extra=20)
    cfg = _config(tmp_path, tmp_path / "cache")
    cfg["task"].update(root=None, include=None,
                       sources=[{"name": "a", "root": str(tmp_path / "a"), "include": ["*.txt"]},
                                {"name": "b", "root": str(tmp_path / "b"), "include": ["*.txt"], "exclude": ["skip"]}])
    result = train_run(cfg, tmp_path / "run")
    assert result.status == "completed" and math.isfinite(result.metrics["test_bpb"])
    folders = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert len(folders) == 1
    meta = (folders[0] / "meta.json").read_text()
    assert '"name": "a"' in meta and '"b/skip/f.txt"' not in meta and '"a/skip/f.txt"' in meta
