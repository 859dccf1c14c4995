"""How many conjugate-gradient steps mesa_net's read-out systems need, with and without a Jacobi preconditioner.

    python -m linattn.ops.mesa_net.convergence [--T 512] [--K 128] [--tol 1e-4]

Builds G_t for every token (the parallel form, float64, CPU), solves (G_t + diag(lamb)) x_t = scale q_t by CG from
x = 0 and prints, per input case, the steps after which the relative residual ||b - A x|| / ||b|| is <= tol for
50%, 99% and all of the tokens, and the largest residual left after 8, 16 and 32 steps. The cases are layer-like
inputs (q, k L2-normalised, beta = sigmoid(noise), lamb 1 or 0.25) under three decays, and keys whose energy
concentrates in few directions: along the coordinate axes (where a diagonal preconditioner can help) or along
random directions (where it cannot).
"""

from __future__ import annotations

import argparse

import torch


def _keys(T: int, K: int, gen: torch.Generator, spread: str) -> torch.Tensor:
    k = torch.randn(1, T, 1, K, dtype=torch.float64, generator=gen)
    if spread != "isotropic":
        k = k / torch.arange(1, K + 1, dtype=torch.float64)  # coordinate i carries energy ~ 1 / i^2
        if spread == "rotated":
            Q, _ = torch.linalg.qr(torch.randn(K, K, dtype=torch.float64, generator=gen))
            k = k @ Q
    return k / k.norm(dim=-1, keepdim=True)


def case_systems(T: int, K: int, g: str, spread: str, lamb: float, seed: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [T, K, K], b [T, K]) of one head: A_t = G_t + diag(lamb), b_t = q_t / sqrt(K)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, 1, K, dtype=torch.float64, generator=gen)
    q = q / q.norm(dim=-1, keepdim=True)
    k = _keys(T, K, gen, spread)
    beta = torch.sigmoid(torch.randn(1, T, 1, dtype=torch.float64, generator=gen))
    noise = torch.randn(1, T, 1, dtype=torch.float64, generator=gen)
    gates = {"layer init": torch.nn.functional.logsigmoid(4.0 + 0.5 * noise),  # MesaNetLayer's a_proj bias 4
             "none": torch.zeros(1, T, 1, dtype=torch.float64),
             "strong": -0.5 * torch.rand(1, T, 1, dtype=torch.float64, generator=gen)}
    gate = gates[g]
    # G_t = sum_{s<=t} exp(Gc_t - Gc_s) beta_s k_s k_s^T for every t (the parallel form's decay matrix)
    Gc = torch.cumsum(gate[0, :, 0], 0)
    w = torch.exp(Gc[:, None] - Gc[None, :]).tril() * beta[0, None, :, 0]  # [t, s]
    kk = k[0, :, 0, :, None] * k[0, :, 0, None, :]
    A = torch.einsum("ts,sij->tij", w, kk) + lamb * torch.eye(K, dtype=torch.float64)
    return A, q[0, :, 0] * K ** -0.5


def residual_history(A: torch.Tensor, b: torch.Tensor, steps: int, jacobi: bool) -> torch.Tensor:
    """[steps + 1, T] relative residuals ||b - A x_n|| / ||b|| of (preconditioned) CG from x_0 = 0."""
    d = torch.diagonal(A, dim1=-2, dim2=-1) if jacobi else torch.ones_like(b)
    x = torch.zeros_like(b)
    r = b.clone()
    z = r / d
    p = z
    rz = (r * z).sum(-1)
    norm_b = b.norm(dim=-1)
    out = [torch.ones_like(norm_b)]
    for _ in range(steps):
        Ap = (A @ p[..., None])[..., 0]
        pAp = (p * Ap).sum(-1)
        alpha = torch.where(pAp > 0, rz / pAp.clamp_min(1e-300), torch.zeros_like(rz))[..., None]
        x = x + alpha * p
        r = r - alpha * Ap
        z = r / d
        rz_new = (r * z).sum(-1)
        p = z + torch.where(rz > 0, rz_new / rz.clamp_min(1e-300), torch.zeros_like(rz))[..., None] * p
        rz = rz_new
        out.append((b - (A @ x[..., None])[..., 0]).norm(dim=-1) / norm_b)
    return torch.stack(out)


def steps_to(history: torch.Tensor, tol: float, quantile: float) -> int | str:
    """Fewest steps n after which a ``quantile`` of the tokens have residual <= tol (">N" if never)."""
    done = (history <= tol).double().mean(-1)
    hits = torch.nonzero(done >= quantile)
    return int(hits[0]) if len(hits) else f">{history.shape[0] - 1}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, default=512)
    parser.add_argument("--K", type=int, default=128)
    parser.add_argument("--tol", type=float, default=1e-4)
    args = parser.parse_args(argv)
    T, K = args.T, args.K
    print(f"T={T}, K={K}, float64; steps until residual <= {args.tol:g} for 50% / 99% / all tokens; "
          "largest residual after 8 / 16 / 32 steps")
    cases = [(g, "isotropic", 1.0) for g in ("layer init", "strong", "none")]
    cases += [("layer init", "isotropic", 0.25), ("none", "isotropic", 0.25)]
    cases += [(g, spread, 1.0) for spread in ("axes", "rotated") for g in ("layer init", "none")]
    for g, spread, lamb in cases:
        A, b = case_systems(T, K, g, spread, lamb)
        cond = torch.linalg.eigvalsh(A[-1])
        for jacobi in (False, True):
            h = residual_history(A, b, min(K, 64) if K > 64 else K, jacobi)
            n = [steps_to(h, args.tol, q) for q in (0.5, 0.99, 1.0)]
            worst = [f"{float(h[min(s, h.shape[0] - 1)].max()):.1e}" for s in (8, 16, 32)]
            print(f"decay {g:10s} keys {spread:9s} lamb {lamb:4.2f} cond(A_T) {float(cond[-1] / cond[0]):8.1f} "
                  f"{'jacobi' if jacobi else 'plain ':6s}: steps {n[0]} / {n[1]} / {n[2]}; "
                  f"residual {' / '.join(worst)}")


if __name__ == "__main__":
    main()
