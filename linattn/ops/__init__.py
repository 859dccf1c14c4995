"""Token mixers as pure functions (no nn.Module), one sub-package per family.

Every op: ``op(q, k, v, <op args>, *, scale=None, initial_state=None, output_final_state=False,
backend="auto", chunk_size=64) -> (o, final_state)`` and ``op_step(q_t, k_t, v_t, <args at t>,
state) -> (o_t, state)``. See DESIGN §2 and ``list_ops()`` / ``op_info(name)``.
"""

from .common.registry import get_op, list_ops
from .simple_gla import simple_gla, simple_gla_step
from .triton_backends import register_triton_backends

register_triton_backends()


def op_info(name: str) -> dict:
    """Metadata of op ``name``: equation, arguments, state shape, available backends."""
    return get_op(name).info()


__all__ = ["get_op", "list_ops", "op_info", "simple_gla", "simple_gla_step"]
