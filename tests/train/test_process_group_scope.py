"""process_group_scope: a process group started in the block ends with it; one from before is left alone."""

import torch.distributed as dist

from linattn.train.distributed import process_group_scope


def _start(tmp_path, name: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / name}", rank=0, world_size=1)


def test_a_group_started_inside_ends_with_the_block(tmp_path):
    assert not dist.is_initialized()
    with process_group_scope():
        _start(tmp_path, "inside")
        assert dist.is_initialized()
    assert not dist.is_initialized()


def test_a_group_from_before_is_left_alone(tmp_path):
    _start(tmp_path, "before")
    try:
        with process_group_scope():
            assert dist.is_initialized()
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


def test_nothing_started_nothing_ended():
    with process_group_scope():
        pass
    assert not dist.is_initialized()
