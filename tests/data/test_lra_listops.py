"""ListOps generator and loader: labels vs an independent evaluator, length filter, uniqueness, the
release layout and an exact round trip through the files."""

import csv
import math
import random
import statistics

import pytest

from linattn.data.lra import LISTOPS_VOCAB, ListOpsConfig, evaluate, generate_trees, get_task, to_source, write_listops
from linattn.data.lra.listops import listops_tokens
from linattn.data.lra.listops_gen import random_tree, tree_length

OPS = {"[MIN": min, "[MAX": max, "[MED": lambda a: math.floor(statistics.median(a)), "[SM": lambda a: sum(a) % 10}
SMALL = dict(num_train=40, num_val=6, num_test=6, min_length=10, max_length=60, max_depth=5, max_args=4, seed=3)


def stack_eval(tokens):
    """Evaluate a parenthesis-free token list with a stack; also return the depth and argument counts."""
    stack, result, depth, nargs = [], None, 0, []
    for t in tokens:
        if t in OPS:
            stack.append((t, []))
            depth = max(depth, len(stack) + 1)  # digits inside sit one level below their operator
        elif t == "]":
            op, args = stack.pop()
            nargs.append(len(args))
            value = OPS[op](args)
            if stack:
                stack[-1][1].append(value)
            else:
                result = value
        else:
            assert t.isdigit() and len(t) == 1, t
            if stack:
                stack[-1][1].append(int(t))
            else:
                result = int(t)
    assert not stack
    return result, depth, nargs


def test_evaluate_by_hand():
    assert evaluate(("[MAX", (2, 9, ("[MIN", (4, 7)), 0))) == 9
    assert evaluate(("[MED", (1, 2))) == 1  # floor of 1.5
    assert evaluate(("[MED", (7, 1, 4))) == 4
    assert evaluate(("[SM", (9, 8, 7))) == 4
    assert stack_eval(listops_tokens("( [MAX 2 9 ( [MIN 4 7 ] ) 0 ]"))[0] == 9


def test_source_format():
    s = to_source(("[MAX", (2, 9, ("[MIN", (4, 7)), 0)))
    assert s == "( ( ( ( ( [MAX 2 ) 9 ) ( ( ( [MIN 4 ) 7 ) ] ) ) 0 ) ] )"
    assert listops_tokens(s) == "[MAX 2 9 [MIN 4 7 ] 0 ]".split()


def test_labels_length_filter_uniqueness():
    cfg = ListOpsConfig(**SMALL)
    trees = generate_trees(cfg)
    assert len(trees) == 52 and len({to_source(t) for t in trees}) == 52
    for t in trees:
        tokens = listops_tokens(to_source(t))
        value, depth, nargs = stack_eval(tokens)
        assert value == evaluate(t)
        assert cfg.min_length < len(tokens) == tree_length(t) < cfg.max_length
        assert depth <= cfg.max_depth and all(2 <= n <= cfg.max_args for n in nargs)
    assert len({evaluate(t) for t in trees}) > 3


def test_lra_default_bounds():
    trees = generate_trees(ListOpsConfig(num_train=3, num_val=1, num_test=1))
    for t in trees:
        tokens = listops_tokens(to_source(t))
        assert 500 < len(tokens) < 2000 and stack_eval(tokens)[0] == evaluate(t)


def test_leaf_probability():
    rng, leaves, nodes = random.Random(0), 0, 0
    for _ in range(4000):  # the root, at depth 1 < max_depth, is a leaf with probability 0.75
        leaves += isinstance(random_tree(rng, 2, 10), int)
        nodes += 1
    assert abs(leaves / nodes - 0.75) < 0.03
    assert all(isinstance(random_tree(rng, 1, 10), int) for _ in range(50))  # depth 1 == max_depth: a leaf


def test_round_trip_through_files(tmp_path):
    cfg = ListOpsConfig(**SMALL)
    folder = write_listops(tmp_path, cfg)
    assert folder == tmp_path / "listops-1000"
    trees = generate_trees(cfg)
    with open(folder / "basic_train.tsv", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t"))
    assert rows[0] == ["Source", "Target"]
    assert rows[1] == [to_source(trees[0]), str(evaluate(trees[0]))]
    offset = {"train": 0, "val": 40, "test": 46}
    for split, n in (("train", 40), ("val", 6), ("test", 6)):
        ds = get_task("listops", tmp_path, split)
        assert len(ds) == n and ds.num_classes == 10
        for i in range(n):
            t = trees[offset[split] + i]
            item = ds[i]
            assert LISTOPS_VOCAB.decode(item["input_ids"]) == listops_tokens(to_source(t))
            assert item["label"].item() == evaluate(t)
            assert stack_eval(LISTOPS_VOCAB.decode(item["input_ids"]))[0] == item["label"].item()


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="listops-1000/basic_train.tsv"):
        get_task("listops", tmp_path, "train")
    with pytest.raises(ValueError, match="split"):
        get_task("listops", tmp_path, "dev")
    with pytest.raises(ValueError, match="max_length"):
        ListOpsConfig(min_length=10, max_length=11)
    with pytest.raises(TypeError, match="max_depth"):
        ListOpsConfig(max_depth=2.5)
    with pytest.raises(RuntimeError, match="distinct"):
        generate_trees(ListOpsConfig(num_train=50, num_val=0, num_test=0, min_length=1, max_length=4, max_depth=2,
                                     max_args=2, max_draws=2000))


def test_command_line_smoke_set(tmp_path):
    from linattn.data.lra.__main__ import LISTOPS_SMOKE, main

    main(["listops", "--out", str(tmp_path), "--smoke", "--seed", "1"])
    ds = get_task("listops", tmp_path, "val")
    assert len(ds) == LISTOPS_SMOKE["num_val"]
    assert all(LISTOPS_SMOKE["min_length"] < ds[i]["input_ids"].numel() < LISTOPS_SMOKE["max_length"]
               for i in range(len(ds)))


def test_command_line_split_sizes(tmp_path, capsys):
    from linattn.data.lra.__main__ import main

    main(["listops", "--out", str(tmp_path), "--smoke", "--num-train", "50", "--num-val", "10", "--num-test", "10"])
    folder = tmp_path / "listops-1000"
    assert str(folder) in capsys.readouterr().out
    for split, n in (("train", 50), ("val", 10), ("test", 10)):
        with open(folder / f"basic_{split}.tsv", newline="") as f:
            rows = list(csv.reader(f, delimiter="\t"))
        assert rows[0] == ["Source", "Target"] and len(rows) - 1 == n, (split, len(rows) - 1)
        assert len(get_task("listops", tmp_path, split)) == n
    main(["listops", "--out", str(tmp_path / "one"), "--smoke", "--num-val", "3"])
    assert len(get_task("listops", tmp_path / "one", "val")) == 3
    assert len(get_task("listops", tmp_path / "one", "test")) == 200, "an unset split keeps the --smoke size"


def test_parallel_draws_give_the_same_trees(monkeypatch):
    """Blocks of trees come from their own seeded streams: two worker processes draw what one draws, in the
    same order, no tree twice."""
    import linattn.data.lra.listops_gen as gen

    monkeypatch.setattr(gen, "BLOCK_TREES", 20)  # several blocks from a small set
    cfg = ListOpsConfig(**{**SMALL, "num_train": 50})
    one = generate_trees(cfg)
    assert len(one) == 62 and len(set(one)) == 62
    assert one[:20] == gen._draw_block(cfg, 0, cfg.max_draws, 20)
    assert generate_trees(cfg, workers=2) == one
    with pytest.raises(TypeError, match="workers"):
        generate_trees(cfg, workers=1.5)
