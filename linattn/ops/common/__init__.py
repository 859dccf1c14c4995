"""Shared pieces of the ops: input checks and the op registry."""

from .checks import Dims, check_qkv, compute_dtype, resolve_scale
from .registry import OpSpec, get_op, list_ops, register_op

__all__ = ["Dims", "OpSpec", "check_qkv", "compute_dtype", "get_op", "list_ops", "register_op", "resolve_scale"]
