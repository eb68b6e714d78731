"""A float64 transcription of Algorithm 1 of the paper, line by line, for one matrix.

Deliberately independent of fira_optim: its own SVD call, its own Adam, explicit matrices.
The paper writes it for m <= n with a left projection P (m x r); for the right projection
(m > n under the "std" rule) the same algorithm runs on the transpose.
"""

from __future__ import annotations

import torch


class Algorithm1:
    def __init__(self, w0, *, lr, rank, T, alpha, gamma=1.01, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, transpose=False, align_signs=False, only_scaling=False):
        self.W = w0.detach().clone().double()
        self.lr, self.r, self.T, self.alpha, self.gamma = lr, rank, T, alpha, gamma
        self.b1, self.b2 = betas
        self.eps, self.wd = eps, weight_decay
        self.transpose = transpose
        self.align_signs = align_signs
        # Fira-only-scaling (Appendix, "Variability of Scaling Factor"): W -= lr * phi(R) G, the
        # scaling factors applied to the whole gradient, the low-rank term P N dropped.
        self.only_scaling = only_scaling
        self.M = self.V = self.P = None
        self.S_prev_norm = None  # no history before the first step
        self.t = 0

    def step(self, G):
        G = G.double()
        if self.transpose:
            G = G.T
        if self.t % self.T == 0:
            if self.transpose:
                # Footnote of Section 3.3: for m > n, Q = V[:, :r] of the SVD of G itself
                # (the left singular vectors of G^T, with the signs that SVD(G) gives).
                _, _, Vh = torch.linalg.svd(G.T, full_matrices=False)
                P_new = Vh[: self.r].T
            else:
                U, _, _ = torch.linalg.svd(G, full_matrices=False)
                P_new = U[:, : self.r]
            if self.align_signs and self.P is not None:
                # Singular vectors are defined up to sign; the paper is silent on which one.
                # Convention (fira_optim's default): P_new[:, i] . P_old[:, i] >= 0.
                P_new = P_new * torch.where((self.P * P_new).sum(0) < 0, -1.0, 1.0).double()
            self.P = P_new
        P = self.P
        R = P.T @ G
        S = G.clone() if self.only_scaling else G - P @ (P.T @ G)  # (I - P P^T) G
        if self.M is None:
            self.M, self.V = torch.zeros_like(R), torch.zeros_like(R)
        t = self.t + 1  # Algorithm 1's t counts from 1 in the bias correction
        self.M = self.b1 * self.M + (1 - self.b1) * R
        self.V = self.b2 * self.V + (1 - self.b2) * R**2
        N = ((1 - self.b2**t) ** 0.5 / (1 - self.b1**t)) * self.M / (self.V.sqrt() + self.eps)
        K = torch.stack([N[:, i].norm() / (R[:, i].norm() + self.eps) for i in range(R.shape[1])])
        S = torch.stack([K[i] * S[:, i] for i in range(S.shape[1])], dim=1)
        if self.S_prev_norm is not None and self.S_prev_norm > 0:
            S = S * self.gamma / max(S.norm() / (self.S_prev_norm + self.eps), self.gamma)
        self.S_prev_norm = S.norm()
        G_tilde = self.alpha * (S if self.only_scaling else P @ N + S)
        if self.transpose:
            G_tilde = G_tilde.T
        self.W = self.W * (1 - self.lr * self.wd) - self.lr * G_tilde
        self.t += 1
        return self.W
