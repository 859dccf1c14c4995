"""Which path a differentiable Triton call takes (ops/common/triton_ops.py): the implementation eagerly, the
registered op under tracing and for tensor subclasses."""

import torch

from linattn.ops.common.triton_ops import traced


class _Wrapped(torch.Tensor):
    """A tensor subclass of the kind a tracer hands over (here a plain one)."""


def test_plain_tensors_and_parameters_run_eagerly():
    x = torch.randn(3)
    weight = torch.nn.Parameter(torch.randn(3))
    assert not traced(x, weight, None, 2.0, [1, 2])
    # a layer hands its parameters over as they are (Parameter.contiguous() is the parameter itself)
    assert not traced(weight.contiguous())


def test_other_subclasses_take_the_registered_op():
    x = torch.randn(3).as_subclass(_Wrapped)
    assert traced(torch.randn(3), x)
