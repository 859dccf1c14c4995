"""Token mixers as pure functions (no nn.Module), one sub-package per family.

Every op: ``op(q, k, v, <op args>, *, <options>, scale=None, initial_state=None, output_final_state=False,
backend="auto", chunk_size=64) -> (o, final_state)`` and its step ``op_step(q, k, v, <op args>, *, state=None,
<options>, scale=None) -> (o_t, state)``: the same argument names in the same order, each tensor holding one
token (no T dim), the state keyword-only. An op takes the state its step returns as ``initial_state`` and a step
takes the op's final state as ``state``. Optional gates are ``g=None`` in both. See ``list_ops()`` /
``op_info(name)``.
"""

from .comba import comba, comba_step
from .common.kv_cache import KVCache
from .common.registry import get_op, list_ops
from .common.triton_step import get_step_backend, set_step_backend
from .common.values import set_value_checks, value_checks
from .delta_rule import delta_rule, delta_rule_step
from .deltaformer import deltaformer, deltaformer_step
from .forgetting_attn import forgetting_attn, forgetting_attn_step
from .gated_delta_product import gated_delta_product, gated_delta_product_step
from .gated_delta_rule import gated_delta_rule, gated_delta_rule_step
from .gla import gla, gla_step
from .linear_attn import FEATURE_MAPS, draw_feature_map_weight, linear_attn, linear_attn_step
from .mesa_net import mesa_net, mesa_net_step
from .path_attn import path_attn, path_attn_step
from .retention import retention, retention_log_decay, retention_step
from .simple_gla import simple_gla, simple_gla_step
from .softmax_attn import softmax_attn, softmax_attn_step
from .triton_backends import register_triton_backends
from .ttt import MiniBatchState, titans, titans_step, ttt_linear, ttt_linear_step

register_triton_backends()


def op_info(name: str) -> dict:
    """Metadata of op ``name``: equation, arguments, state shape, available backends."""
    return get_op(name).info()


__all__ = [
    "comba", "comba_step", "delta_rule", "delta_rule_step", "deltaformer", "deltaformer_step",
    "draw_feature_map_weight", "FEATURE_MAPS", "forgetting_attn", "forgetting_attn_step", "gated_delta_product",
    "gated_delta_product_step", "gated_delta_rule", "gated_delta_rule_step", "get_op", "get_step_backend", "gla",
    "gla_step", "KVCache", "linear_attn", "linear_attn_step", "list_ops", "mesa_net", "mesa_net_step", "MiniBatchState",
    "op_info", "path_attn", "path_attn_step", "retention", "retention_log_decay", "retention_step", "set_step_backend",
    "set_value_checks", "simple_gla", "simple_gla_step", "softmax_attn", "softmax_attn_step", "titans", "titans_step",
    "ttt_linear", "ttt_linear_step", "value_checks",
]
