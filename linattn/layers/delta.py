"""Layers of the delta-rule family: DeltaNet, Gated DeltaNet, Comba, MesaNet."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from linattn.ops.comba import comba, comba_step
from linattn.ops.delta_rule import delta_rule, delta_rule_step
from linattn.ops.gated_delta_rule import gated_delta_rule, gated_delta_rule_step
from linattn.ops.mesa_net import mesa_net, mesa_net_step

from .base import MixerLayer, MixOut, Streams
from .fused import use_fused_kernels
from .gates import MambaDecay
from .norms import l2norm_pair


class _BetaLayer(MixerLayer):
    """Shared by the delta rules: L2-normalised q, k; beta = sigmoid(W_b x) per head (times 2 with
    ``allow_neg_eigval``, so beta in (0, 2) and the transition may have negative eigenvalues)."""

    default_short_conv = "qkv"

    def __init__(self, d_model: int, n_heads: int, *, allow_neg_eigval: bool = False, **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        self.allow_neg_eigval = bool(allow_neg_eigval)
        self.b_proj = nn.Linear(d_model, n_heads, bias=False)

    def x_projections(self) -> dict[str, nn.Linear]:
        return {**super().x_projections(), "b": self.b_proj}

    def beta(self, streams: Streams) -> torch.Tensor:
        """sigmoid(W_b x) (times 2 with ``allow_neg_eigval``) from the projected streams."""
        b = torch.sigmoid(streams["b"])
        return 2 * b if self.allow_neg_eigval else b


class DeltaNetLayer(_BetaLayer):
    """DeltaNet (Schlag et al. 2021; Yang et al., arXiv 2406.06484) on :func:`linattn.ops.delta_rule.delta_rule`.

    q, k L2-normalised per head, beta_t = sigmoid(W_b x_t),
    S_t = (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T, o_t = S_t^T (q_t / sqrt(K));
    ShortConv (SiLU) on q, k, v by default; output RMSNorm per head, no gate (FLA's defaults).
    """

    op = staticmethod(delta_rule)
    op_step = staticmethod(delta_rule_step)
    step_inplace = True
    qk_feature_map = "l2"  # mix_inputs L2-normalises q and k and passes v on

    def mix_inputs(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, offset: int, streams: Streams) -> MixOut:
        beta = self.beta(streams).to(q.dtype)
        return *l2norm_pair(q, k), v, {"beta": beta}, {"allow_neg_eigval": self.allow_neg_eigval}


class GatedDeltaNetLayer(_BetaLayer):
    """Gated DeltaNet (arXiv 2412.06464) on :func:`linattn.ops.gated_delta_rule.gated_delta_rule`.

    q, k L2-normalised, beta_t = sigmoid(W_b x_t), g_t = -exp(A_log) softplus(W_a x_t + dt_bias),
    S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T, o_t = S_t^T (q_t / sqrt(K));
    ShortConv on q, k, v by default; output RMSNorm per head times SiLU(W_g x).
    """

    op = staticmethod(gated_delta_rule)
    op_step = staticmethod(gated_delta_rule_step)
    step_inplace = True
    default_output_gate = True
    qk_feature_map = "l2"  # mix_inputs L2-normalises q and k and passes v on

    def __init__(self, d_model: int, n_heads: int, **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        self.decay = MambaDecay(d_model, n_heads)

    def x_projections(self) -> dict[str, nn.Linear]:
        return {**super().x_projections(), "a": self.decay.a_proj}

    def mix_inputs(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, offset: int, streams: Streams) -> MixOut:
        g, beta = self.decay.with_beta(streams["a"], streams["b"], q.dtype)
        args = {"g": g, "beta": 2 * beta if self.allow_neg_eigval else beta}
        return *l2norm_pair(q, k), v, args, {"allow_neg_eigval": self.allow_neg_eigval}


def read_key(k: Tensor, d: Tensor) -> Tensor:
    """Comba's read key sigmoid(d) ⊙ k (k [..., H, K], d [H, K]) in k's dtype: one fused kernel each way on CUDA
    (read_keys_triton.py)."""
    if use_fused_kernels(k):
        from .read_keys_triton import read_keys_triton

        return read_keys_triton(k, d)
    return torch.sigmoid(d).to(k.dtype) * k


class CombaLayer(GatedDeltaNetLayer):
    """Comba (arXiv 2506.02475) on :func:`linattn.ops.comba.comba`: Gated DeltaNet's layer with the
    prediction read by its own key p_t = sigmoid(d) ⊙ k_t (d [H, K] learned, sigmoid(d) = 0.5 at init):

    S_t = exp(g_t) S_{t-1} + b_t k_t (v_t - exp(g_t) S_{t-1}^T p_t)^T,  o_t = S_t^T (q_t / sqrt(K)).
    """

    op = staticmethod(comba)
    op_step = staticmethod(comba_step)
    step_inplace = False  # comba_step is PyTorch only (the fused kernel has no separate read key)
    qk_feature_map = "l2"  # mix_inputs L2-normalises q and k and passes v on

    def __init__(self, d_model: int, n_heads: int, **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        self.d = nn.Parameter(torch.zeros(n_heads, self.head_dim))

    def mix_inputs(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, offset: int, streams: Streams) -> MixOut:
        q, k, v, args, kw = super().mix_inputs(x, q, k, v, offset, streams)
        return q, k, v, {"p": read_key(k, self.d), **args}, kw


class MesaNetLayer(MixerLayer):
    """MesaNet (arXiv 2506.05233) on :func:`linattn.ops.mesa_net.mesa_net`.

    q, k L2-normalised, g_t = logsigmoid(W_a x_t) (per head), beta_t = sigmoid(W_b x_t),
    lamb = softplus(lamb_raw) + 0.25 ([H, K], 1 at init), G_t = exp(g_t) G_{t-1} + b_t k_t k_t^T,
    H_t = exp(g_t) H_{t-1} + b_t k_t v_t^T, o_t = H_t^T (G_t + diag(lamb))^-1 (q_t / sqrt(K));
    ``solver`` "exact" or "cg" (``cg_steps``); ShortConv on q, k, v; output RMSNorm times SiLU(W_g x).
    """

    op = staticmethod(mesa_net)
    op_step = staticmethod(mesa_net_step)
    default_short_conv = "qkv"
    qk_feature_map = "l2"
    default_output_gate = True

    def __init__(self, d_model: int, n_heads: int, *, solver: str = "exact", cg_steps: int | None = None,
                 **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        if solver not in ("exact", "cg"):
            raise ValueError(f"solver must be one of 'exact', 'cg'; got {solver!r}")
        self.solver, self.cg_steps = solver, cg_steps
        self.a_proj = nn.Linear(d_model, n_heads, bias=True)
        nn.init.constant_(self.a_proj.bias, 4.0)  # decays near 1 at init
        self.b_proj = nn.Linear(d_model, n_heads, bias=False)
        lamb0 = float(torch.log(torch.expm1(torch.tensor(0.75))))  # softplus^-1(0.75)
        self.lamb_raw = nn.Parameter(torch.full((n_heads, self.head_dim), lamb0))

    @property
    def graph_capturable(self) -> bool:
        """The exact solver's batched Cholesky factorisation (cuSOLVER) cannot be captured in a CUDA graph (on the
        H100: "operation not permitted when stream is capturing"); conjugate gradient can."""
        return self.solver != "exact"

    def mix_inputs(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, offset: int, streams: Streams) -> MixOut:
        g = F.logsigmoid(self.a_proj(x)).to(q.dtype)
        beta = torch.sigmoid(streams["b"]).to(q.dtype)
        lamb = (F.softplus(self.lamb_raw) + 0.25).to(q.dtype)
        kw = {"lamb": lamb, "solver": self.solver, "cg_steps": self.cg_steps}  # lamb: one [H, K] for every token
        return *l2norm_pair(q, k), v, {"g": g, "beta": beta}, kw

    def x_projections(self) -> dict[str, nn.Linear]:
        return {**super().x_projections(), "b": self.b_proj}

    def static_state(self, batch_size: int, max_length: int, dtype: torch.dtype,
                     device: torch.device) -> tuple[Tensor, Tensor]:
        """The pair (G [B, H, K, K], H [B, H, K, V])."""
        B, H, K = batch_size, self.n_heads, self.head_dim
        return (torch.zeros(B, H, K, K, dtype=dtype, device=device),
                torch.zeros(B, H, K, self.head_dim_v, dtype=dtype, device=device))
