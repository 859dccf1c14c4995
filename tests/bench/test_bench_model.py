"""``linattn bench model`` runs end to end through the CLI at a tiny size (function, not timing): rows per
mixer with ratios to softmax_attn, errors recorded per row, compiled mode, resume, the decode-path hook."""

import json

import pytest
import torch

from linattn.bench import model as bench_model
from linattn.cli import build_parser, main
from linattn.layers import GLALayer

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--d-model", "32", "--layers", "2", "--heads", "2", "--vocab", "64", "--shapes", "2x32", "--steps", "1",
        "--warmup", "1", "--decode-batch", "1", "--decode-context", "8", "--decode-tokens", "2", "--no-progress"]


def run(tmp_path, *extra: str) -> dict:
    out = tmp_path / "model.json"
    assert main(["bench", "model", *TINY, "--out", str(out), *extra]) == 0
    return json.loads(out.read_text())


def rows_of(data: dict, kind: str) -> dict:
    return {(r["mixer"], r.get("mode", r.get("path"))): r for r in data["rows"] if r["kind"] == kind}


def test_two_mixers_with_the_reference(tmp_path, capsys):
    data = run(tmp_path, "--mixers", "gla,delta_rule", "--profile", "--profile-top", "3")
    header = data["header"]
    assert data["bench"] == "model" and {"date", "device", "torch", "triton", "command", "settings"} <= set(header)
    assert header["command"].startswith("linattn bench model --d-model 32")
    assert header["settings"]["d_model"] == 32 and header["measured"]["mixers"] == ["softmax_attn", "gla", "delta_rule"]
    train, decode = rows_of(data, "train"), rows_of(data, "decode")
    assert set(train) == {("softmax_attn", "eager"), ("gla", "eager"), ("delta_rule", "eager")}
    assert set(decode) == {("softmax_attn", "eager"), ("gla", "eager"), ("delta_rule", "eager")}
    assert data["rows"][0]["mixer"] == "softmax_attn"  # measured first: every later row has its ratio at once
    for r in train.values():
        assert r["error"] is None and r["tokens_per_s"] > 0 and r["ms_per_step"] > 0 and r["params_m"] > 0
        ref = train[("softmax_attn", "eager")]
        assert r["speed_ratio"] == pytest.approx(r["tokens_per_s"] / ref["tokens_per_s"])
        assert r["synced_ms_per_step"] > 0
        assert r["synced_speed_ratio"] == pytest.approx(ref["synced_ms_per_step"] / r["synced_ms_per_step"])
        assert r["peak_gib"] is None and r["memory_ratio"] is None  # no allocator peak on the CPU
        assert 1 <= len(r["profile"]["top"]) <= 3 and r["profile"]["wall_ms"] > 0
    for r in decode.values():
        assert r["error"] is None and r["ms_per_token"] > 0 and r["speed_ratio"] > 0
        assert r["tokens_per_s"] == pytest.approx(1e3 / r["ms_per_token"])  # batch 1
    printed = capsys.readouterr().out
    assert "x softmax_attn" in printed and "| gla | 2x32 | eager |" in printed and "| delta_rule | 1 | 8 |" in printed


def test_a_failing_mixer_is_an_error_row(tmp_path, monkeypatch):
    def broken(self, *args, **kwargs):
        raise RuntimeError("mixer exploded")

    monkeypatch.setattr(GLALayer, "forward", broken)
    data = run(tmp_path, "--mixers", "gla,retention")
    train, decode = rows_of(data, "train"), rows_of(data, "decode")
    for rows in (train, decode):
        failed = rows[("gla", "eager")]
        assert failed["error"] == "RuntimeError: mixer exploded" and failed["tokens_per_s"] is None
        assert failed["speed_ratio"] is None
        for mixer in ("softmax_attn", "retention"):
            assert rows[(mixer, "eager")]["error"] is None and rows[(mixer, "eager")]["tokens_per_s"] > 0
    monkeypatch.undo()  # mended: --retry-errors measures the failed rows again, and only those
    data = run(tmp_path, "--mixers", "gla,retention", "--resume", "--retry-errors")
    again = [(r["kind"], r["mixer"]) for r in data["rows"] if r["run"] == 1]
    assert again == [("train", "softmax_attn"), ("train", "gla"), ("decode", "softmax_attn"), ("decode", "gla")]
    assert len(data["rows"]) == 8 and not any(r["error"] for r in data["rows"])


@pytest.mark.parametrize("scope, modes", [("model", ("eager", "compiled")), ("blocks", ("compiled",))])
def test_compiled_mode(tmp_path, scope, modes):
    data = run(tmp_path, "--mixers", "gla", "--modes", ",".join(modes), "--compile-backend", "aot_eager",
               "--compile-scope", scope, "--no-decode")
    train = rows_of(data, "train")
    assert set(train) == {(m, mode) for m in ("softmax_attn", "gla") for mode in modes}
    for (_, mode), r in train.items():
        assert r["error"] is None and r["tokens_per_s"] > 0
        assert (r["compile_s"] is not None) == (mode == "compiled")
    assert train[("gla", "compiled")]["compile_s"] > 0 and train[("gla", "compiled")]["graph_breaks"] >= 0
    assert not rows_of(data, "decode")


def test_compile_mode_reaches_torch_compile(monkeypatch):
    seen = []
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: seen.append(kwargs) or model)
    model = torch.nn.Linear(2, 2)
    bench_model.compile_model(model, "inductor", "model", "reduce-overhead")
    bench_model.compile_model(model, "inductor")
    assert seen == [{"backend": "inductor", "mode": "reduce-overhead"}, {"backend": "inductor", "mode": None}]
    with pytest.raises(ValueError, match="compile mode must be one of"):
        bench_model.compile_model(model, "inductor", "model", "fastest")


def test_resume_measures_only_missing_rows(tmp_path, monkeypatch):
    run(tmp_path, "--mixers", "gla", "--no-decode")
    measured = []
    real = bench_model.measure_training
    monkeypatch.setattr(bench_model, "measure_training",
                        lambda plan, mixer, *a: measured.append(mixer) or real(plan, mixer, *a))
    data = run(tmp_path, "--mixers", "gla,delta_rule", "--no-decode", "--resume")
    assert measured == ["softmax_attn", "delta_rule"]  # the reference again: ratios are taken within one process
    assert [(r["mixer"], r["run"]) for r in data["rows"]] == [("softmax_attn", 0), ("gla", 0), ("softmax_attn", 1),
                                                              ("delta_rule", 1)]
    new_ref, new = data["rows"][2:]
    assert new["speed_ratio"] == pytest.approx(new["tokens_per_s"] / new_ref["tokens_per_s"])
    assert len(data["earlier_runs"]) == 1
    assert main(["bench", "model", *TINY, "--out", str(tmp_path / "model.json"), "--mixers", "gla,delta_rule",
                 "--no-decode", "--resume"]) == 0
    assert measured == ["softmax_attn", "delta_rule"]  # nothing left to measure
    # other settings: the earlier rows are not comparable, and the run refuses to mix them
    assert main(["bench", "model", *TINY, "--out", str(tmp_path / "model.json"), "--resume", "--steps", "2"]) == 2


@pytest.mark.parametrize("argv", [["--mixers", "nope"], ["--shapes", "2by32"], ["--modes", "jit"],
                                  ["--decode-path", "warp"], ["--mixer-kwargs", '{"gla": 3}'],
                                  ["--mixer-kwargs", '{"gla": {"no_such_argument": 1}}'], ["--heads", "5"],
                                  ["--profile-top", "0"]]
                         + ([["--device", "cuda"]] if not torch.cuda.is_available() else []))
def test_bad_options_exit_2(argv, capsys):
    assert main(["bench", "model", *TINY, *argv]) == 2
    assert "linattn bench model:" in capsys.readouterr().err


def test_decode_paths_plug_in(monkeypatch):
    calls = []
    monkeypatch.setitem(bench_model.DECODE_PATHS, "fake", lambda m, b, c, n: calls.append((b, c, n)) or 0.5)
    assert bench_model.time_decoding(None, 2, 16, 4, path="fake") == 0.5 and calls == [(2, 16, 4)]
    with pytest.raises(ValueError, match="unknown decode path 'warp'; available: eager"):
        bench_model.time_decoding(None, 1, 8, 2, path="warp")


def test_packed_rows_beside_the_fixed_ones(tmp_path, capsys):
    """--packed: per mixer a row on packed documents (B*T tokens as one row with cu_seqlens) right after its
    fixed-length row, with its ratio to it; the packings hold exactly B*T tokens."""
    data = run(tmp_path, "--mixers", "gated_delta_rule", "--packed", "--doc-lengths", "5,24", "--no-decode")
    rows = [r for r in data["rows"] if r["kind"] == "train"]
    assert [(r["mixer"], r["layout"]) for r in rows] == [("softmax_attn", "fixed"), ("softmax_attn", "packed"),
                                                         ("gated_delta_rule", "fixed"), ("gated_delta_rule", "packed")]
    for fixed, packed in (rows[:2], rows[2:]):
        assert packed["error"] is None and packed["tokens_per_s"] > 0 and packed["documents"] >= 64 / 24
        assert packed["fixed_row_ratio"] == pytest.approx(packed["tokens_per_s"] / fixed["tokens_per_s"])
        assert packed["packed_ratio"] > 0 and fixed["packed_ratio"] is None and fixed["fixed_row_ratio"] is None
        assert packed["packed_ratio_synced"] > 0 and fixed["packed_ratio_synced"] is None
    assert data["header"]["settings"]["doc_lengths"] == [5, 24] and data["header"]["measured"]["packed"]
    assert "| gated_delta_rule | 1x64 packed | eager |" in capsys.readouterr().out


def test_packed_rows_count_the_kernels_compiled_after_their_first_step(tmp_path, monkeypatch):
    """The packed row keeps the kernel variants compiled between its first step and the end of its timing; on the
    CPU nothing compiles (None), and fixed-length rows count nothing."""
    counts = iter([40, 43])
    monkeypatch.setattr(bench_model, "compiled_variants", lambda: next(counts))
    rows = run(tmp_path, "--mixers", "softmax_attn", "--packed", "--doc-lengths", "5,24", "--no-decode")["rows"]
    assert [r["kernels_compiled_after_first_step"] for r in rows] == [None, 3]
    monkeypatch.setattr(bench_model, "compiled_variants", lambda: None)
    rows = run(tmp_path / "cpu", "--mixers", "softmax_attn", "--packed", "--doc-lengths", "5,24", "--no-decode")["rows"]
    assert [r["kernels_compiled_after_first_step"] for r in rows] == [None, None]


def test_alternated_ratio_is_the_median_of_the_pairs(monkeypatch):
    """The packed row's ratio to the fixed-length step: first's time over second's per pair, in alternation."""
    calls, times = [], iter([2.0, 1.0, 9.0, 3.0, 4.0, 4.0])  # pairs' ratios 2, 3, 1: median 2
    monkeypatch.setattr(bench_model, "_seconds", lambda fn, device: (calls.append(fn()), next(times))[1])
    ratio = bench_model.alternated_ratio(lambda: "fixed", lambda: "packed", 3, torch.device("cpu"))
    assert ratio == 2.0 and calls == ["fixed", "packed"] * 3


def test_alternated_pipelined_ratio_runs_back_to_back_in_alternation(monkeypatch):
    """Runs of ``steps`` back-to-back steps, first's then second's, per pair; the median of the pairs' ratios."""
    calls, times = [], iter([6.0, 2.0, 3.0, 3.0, 8.0, 2.0])  # pairs' ratios 3, 1, 4: median 3

    def fake_pipelined(fn, steps, device, rounds):
        calls.extend(fn() for _ in range(steps))
        assert rounds == 1
        return next(times)

    monkeypatch.setattr(bench_model, "pipelined_ms", fake_pipelined)
    ratio = bench_model.alternated_pipelined_ratio(lambda: "fixed", lambda: "packed", 2, torch.device("cpu"), pairs=3)
    assert ratio == 3.0 and calls == ["fixed", "fixed", "packed", "packed"] * 3


def test_packed_documents_fill_the_step_exactly():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        offsets = bench_model.packed_documents(4096, 64, 4096, gen)
        lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
        assert offsets[0] == 0 and offsets[-1] == 4096 and all(0 < n <= 4096 for n in lengths)
        assert all(n >= 64 for n in lengths[:-1])


@pytest.mark.parametrize("argv", [["--doc-lengths", "64"], ["--doc-lengths", "100,50"], ["--doc-lengths", "0,5"]])
def test_bad_doc_lengths_exit_2(argv, capsys):
    assert main(["bench", "model", *TINY, "--packed", *argv]) == 2
    assert "--doc-lengths" in capsys.readouterr().err


def test_pipelined_time_is_the_mean_of_back_to_back_steps_after_a_lead_step(monkeypatch):
    clock, calls, synced_at = [0.0], [], []
    monkeypatch.setattr(bench_model.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(bench_model, "synchronize", lambda device: synced_at.append(len(calls)))

    def step():  # the three rounds' steps take 2, 4 and 6 ms; each round's untimed lead step 100 ms
        calls.append(1)
        lead = (len(calls) - 1) % 6 == 0
        clock[0] += 0.1 if lead else 2e-3 * (1 + (len(calls) - 1) // 6)

    ms = bench_model.pipelined_ms(step, steps=5, device=torch.device("cpu"), rounds=3)
    assert ms == pytest.approx(4.0) and len(calls) == 18
    assert synced_at == [0, 6, 6, 12, 12, 18]  # before and after each round, never between its steps


def test_pipelined_time_on_cuda_is_the_time_between_events_around_the_timed_steps(monkeypatch):
    """On CUDA the clock is two events recorded after the lead step and after the last step, not the host's."""
    recorded, calls = [], []

    class FakeEvent:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            recorded.append(len(calls))
            self.at = len(calls)

        def elapsed_time(self, end):
            return 3.0 * (end.at - self.at)

    monkeypatch.setattr(bench_model.torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(bench_model, "synchronize", lambda device: None)
    ms = bench_model.pipelined_ms(lambda: calls.append(1), steps=4, device=torch.device("cuda"), rounds=2)
    assert ms == pytest.approx(3.0) and recorded == [1, 5, 6, 10]


def test_a_row_takes_its_speed_from_the_back_to_back_time(monkeypatch):
    monkeypatch.setattr(bench_model, "median_ms", lambda *a, **k: 40.0)  # each step synchronised on its own
    monkeypatch.setattr(bench_model, "pipelined_ms", lambda *a, **k: 25.0)  # back to back
    plan = bench_model.plan_from_args(build_parser().parse_args(["bench", "model", *TINY, "--mixers", "gla"]))
    row = bench_model.TrainRow("gla", 2, 32, "eager")
    bench_model._train_once(plan, row)
    assert (row.ms_per_step, row.synced_ms_per_step) == (25.0, 40.0)
    assert row.tokens_per_s == pytest.approx(2 * 32 / 25e-3)
