"""Orthogonal matrices for rotating a model (`rotate.py`): normalized Hadamard matrices of
any order that is a product of Sylvester (powers of two) and Paley orders, and random
orthogonal matrices for what is left.

A Hadamard matrix H of order n has entries ±1 and H·Hᵀ = n·I; H/√n is orthogonal and spreads
every coordinate evenly over all others (QuaRot, Ashkboos et al. 2024). The Kronecker
product of Hadamard matrices is one, so an order is built from factors:

- Sylvester: order 2^k, H₂ₖ = [[H, H], [H, -H]];
- Paley I: order q + 1 for a prime q ≡ 3 (mod 4) (12, 20, 24, 32, 44, 48, 60, ...);
- Paley II: order 2(q + 1) for a prime q ≡ 1 (mod 4) (12, 28, 36, 60, ...).

576 (smollm2's hidden size, 9·64) is Paley I(12) ⊗ Paley I(12) ⊗ Sylvester(4); 896 is
Paley II(28) ⊗ Sylvester(32). An order with no such factorisation takes the largest
factorable divisor d and a seeded random orthogonal matrix of order n/d (`orthogonal`)."""

from __future__ import annotations

import functools

import torch


def _prime(q: int) -> bool:
    return q > 1 and all(q % d for d in range(2, int(q**0.5) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[i, j] = χ(j - i), the quadratic character of GF(q) (q prime)."""
    squares = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if a in squares else -1.0 for a in range(1, q)], dtype=torch.float64)
    i = torch.arange(q)
    return chi[(i[None, :] - i[:, None]) % q]


def paley1(q: int) -> torch.Tensor:
    """The ±1 Hadamard matrix of order q + 1 (q prime, q ≡ 3 mod 4): I + [[0, 1ᵀ], [-1, Q]]."""
    n = q + 1
    c = torch.zeros(n, n, dtype=torch.float64)
    c[0, 1:], c[1:, 0], c[1:, 1:] = 1, -1, _jacobsthal(q)
    return c + torch.eye(n, dtype=torch.float64)


def paley2(q: int) -> torch.Tensor:
    """The ±1 Hadamard matrix of order 2(q + 1) (q prime, q ≡ 1 mod 4): C = [[0, 1ᵀ], [1, Q]]
    with each 0 replaced by [[1, -1], [-1, -1]] and each ±1 by ±[[1, 1], [1, -1]]."""
    n = q + 1
    c = torch.zeros(n, n, dtype=torch.float64)
    c[0, 1:], c[1:, 0], c[1:, 1:] = 1, 1, _jacobsthal(q)
    a = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    b = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    return torch.kron(c, a) + torch.kron(torch.eye(n, dtype=torch.float64), b)


def sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h


def _paley_orders(n: int) -> list[tuple[str, int]]:
    """(construction, order) of every Paley matrix whose order divides n (not a power of two)."""
    found = []
    for d in range(12, n + 1, 4):
        if n % d or d & (d - 1) == 0:
            continue
        if _prime(d - 1) and (d - 1) % 4 == 3:
            found.append(("paley1", d))
        elif d % 2 == 0 and _prime(d // 2 - 1) and (d // 2 - 1) % 4 == 1:
            found.append(("paley2", d))
    return found


@functools.lru_cache(maxsize=None)
def factors(n: int) -> tuple[tuple[str, int], ...] | None:
    """Hadamard factors (construction, order) whose Kronecker product has order n, largest
    Paley first, then one Sylvester; None when n has no such factorisation."""
    if n & (n - 1) == 0:
        return (("sylvester", n),)
    for kind, d in reversed(_paley_orders(n)):
        rest = factors(n // d)
        if rest is not None:
            return ((kind, d),) + rest
    return None


BUILD = {"sylvester": sylvester, "paley1": lambda d: paley1(d - 1), "paley2": lambda d: paley2(d // 2 - 1)}


def orthogonal(n: int, generator: torch.Generator) -> torch.Tensor:
    """A random orthogonal matrix of order n (Haar: QR of a Gaussian, signs fixed by R's diagonal)."""
    q, r = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=generator))
    return (q * torch.sign(torch.diagonal(r))[None, :]).contiguous()


def hadamard(n: int, generator: torch.Generator) -> tuple[torch.Tensor, str]:
    """(an orthogonal [n, n] fp64 matrix, how it was built): a normalized Hadamard matrix when n
    factors (`factors`), else the largest factorable divisor's Kronecker a random orthogonal
    matrix drawn from `generator` for the rest."""
    d = max(k for k in range(1, n + 1) if n % k == 0 and factors(k) is not None)
    parts = factors(d)
    h = torch.ones(1, 1, dtype=torch.float64)
    for kind, order in parts:
        h = torch.kron(h, BUILD[kind](order))
    h = h / d**0.5
    words = [f"{kind}({order})" for kind, order in parts if order > 1]
    if d < n:
        h = torch.kron(orthogonal(n // d, generator), h)
        words.insert(0, f"random-orthogonal({n // d})")
    return h, f"{' ⊗ '.join(words) or 'identity'}" + (f" / √{d}" if d > 1 else "")
