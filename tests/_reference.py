"""A dense re-implementation of GaLore used as the tests' oracle.

It keeps the full weight W and the full gradient G, projects G explicitly and runs Adam on the
projection, with the step semantics of hf_galore_plugin (documented in layers/linear.py and docs/guides/how-it-works.md):
step 0 calibrates (weight decay only, first basis from G_0, moments reset), a basis computed from
G_t is used from step t+1, refreshes every `gap` steps, and moments kept / projected / reset.
"""

from __future__ import annotations

import torch

from hf_galore_plugin.config import GaLoreConfig
from hf_galore_plugin.projection import compute_basis, resolve_sides, transport_matrix


class DenseGaLore:
    def __init__(self, weight: torch.Tensor, config: GaLoreConfig, *, lr, weight_decay, betas=(0.9, 0.999), eps=1e-8):
        self.w = weight.detach().double().clone()
        self.config = config
        self.lr, self.wd, self.betas, self.eps = lr, weight_decay, betas, eps
        m, n = weight.shape
        has_left, has_right = resolve_sides(config.proj_type, m, n)
        self.ranks = {}
        if has_left:
            self.ranks["left"] = min(config.rank, m)
        if has_right:
            self.ranks["right"] = min(config.rank, n)
        self.identity = {"left": config.rank >= m, "right": config.rank >= n}
        self.bases = {s: None for s in self.ranks}
        self.exp_avg = self.exp_avg_sq = None
        self.adam_t = 0
        self.step_index = 0
        self.last_refresh = -1
        self.gap = config.update_proj_gap
        needs = any(not self.identity[s] for s in self.ranks)
        self.calibrated = not needs

    def _basis(self, side):
        if self.identity[side]:
            return None
        return self.bases[side]

    def project(self, g):
        p, q = (
            (self._basis("left") if "left" in self.ranks else None),
            (self._basis("right") if "right" in self.ranks else None),
        )
        if p is not None:
            g = p.T @ g
        if q is not None:
            g = g @ q
        return g

    def project_back(self, r):
        p, q = (
            (self._basis("left") if "left" in self.ranks else None),
            (self._basis("right") if "right" in self.ranks else None),
        )
        if q is not None:
            r = r @ q.T
        if p is not None:
            r = p @ r
        return r

    def step(self, grad: torch.Tensor) -> None:
        grad = grad.detach().double()
        self.w *= 1 - self.lr * self.wd
        if self.calibrated:
            r = self.project(grad)
            b1, b2 = self.betas
            if self.exp_avg is None:
                self.exp_avg = torch.zeros_like(r)
                self.exp_avg_sq = torch.zeros_like(r)
            self.adam_t += 1
            self.exp_avg = b1 * self.exp_avg + (1 - b1) * r
            self.exp_avg_sq = b2 * self.exp_avg_sq + (1 - b2) * r * r
            m_hat = self.exp_avg / (1 - b1**self.adam_t)
            v_hat = self.exp_avg_sq / (1 - b2**self.adam_t)
            update = m_hat / (v_hat.sqrt() + self.eps)
            self.w -= self.lr * self.config.scale * self.project_back(update)
        due = (not self.calibrated) or (self.step_index - self.last_refresh >= self.gap)
        if due and any(not self.identity[s] for s in self.ranks):
            self._refresh(grad)
        self.step_index += 1

    def _refresh(self, grad):
        first = not self.calibrated
        old = dict(self.bases)
        for side, rank in self.ranks.items():
            if not self.identity[side]:
                self.bases[side] = compute_basis(grad.float(), side=side, rank=rank).double()
        if first or self.config.moment_handling == "reset":
            self.exp_avg = self.exp_avg_sq = None
            self.adam_t = 0
        elif self.config.moment_handling == "project" and self.exp_avg is not None:
            for side in self.ranks:
                if self.identity[side]:
                    continue
                t = transport_matrix(old[side], self.bases[side]).double()
                if side == "left":
                    self.exp_avg = t.T @ self.exp_avg
                    self.exp_avg_sq = (t * t).T @ self.exp_avg_sq
                else:
                    self.exp_avg = self.exp_avg @ t
                    self.exp_avg_sq = self.exp_avg_sq @ (t * t)
        self.calibrated = True
        self.last_refresh = self.step_index
