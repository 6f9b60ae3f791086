"""What an honest client's private upload can hold, and a clip-norm step that stays positive and finite.

Under client-level DP without secure aggregation the server sees each upload: the clipped update,
plus (adaptive clipping) the bit [‖Δ‖ ≤ C] as one more coordinate, each with the client's noise
share when ``noise_at = "clients"``. :func:`check_private_upload` refuses what no honest client
sends; the bounds leave a false refusal of an honest noisy upload below 1e-21:

- the update's L2 norm is at most ``C·(1 + 1e-4) + σ·(√d + 10)``, σ the client's noise std per
  coordinate (Gaussian concentration: P(‖N(0, σ²I_d)‖ > σ(√d + t)) ≤ exp(−t²/2));
- the count lies in ``[−10σ_b, 1 + 10σ_b]``, σ_b the client's count noise std (exactly 0 or 1 when
  it adds none).

Under secure aggregation the server sees only the sum, so the clip norm's update itself is bounded
(:func:`next_clip_norm`): a non-finite count leaves it, and it stays within ``CLIP_RANGE`` of the
configured value.
"""

from __future__ import annotations

import math

import numpy as np

NORM_SLACK = 1e-4  # float32 rounding of a clipped update (relative)
TAIL_SIGMAS = 10.0  # a noise draw further out than this is not honest (P < 1e-21)
CLIP_RANGE = 1e6  # adaptive clipping keeps clip_norm within [C₀ / 1e6, C₀ · 1e6]


def check_private_upload(
    update: np.ndarray, count_coords: int, clip: float, noise_std: float, count_std: float
) -> str | None:
    """Why an upload of client-level DP cannot be an honest client's, or None.

    ``update`` is the clipped update with ``count_coords`` count coordinates appended; ``clip`` the
    clip norm the client was sent; ``noise_std`` and ``count_std`` the std of the noise the client
    itself adds to each update coordinate and to its count (0 when the server adds the noise).
    """
    d = update.size - count_coords
    norm = float(np.linalg.norm(update[:d].astype(np.float64)))
    most = clip * (1 + NORM_SLACK) + noise_std * (math.sqrt(d) + TAIL_SIGMAS)
    if not norm <= most:
        return f"update norm {norm:.6g} exceeds the clip norm {clip:.6g} (at most {most:.6g} with its noise)"
    for c in update[d:].astype(np.float64):
        if count_std > 0:
            lo, hi = -TAIL_SIGMAS * count_std, 1 + TAIL_SIGMAS * count_std
            if not lo <= c <= hi:
                return f"clip count {c:.6g} is outside [{lo:.6g}, {hi:.6g}]"
        elif c not in (0.0, 1.0):
            return f"clip count {c:.6g} is not 0 or 1"
    return None


def next_clip_norm(clip: float, share: float, lr: float, quantile: float, configured: float) -> float:
    """The geometric step ``C·exp(−lr·(share − quantile))`` (Andrew et al. 2021), computed in logs and
    kept in ``[configured / CLIP_RANGE, configured · CLIP_RANGE]``; a non-finite share keeps ``C``."""
    if not math.isfinite(share):
        return clip
    lo, hi = math.log(configured / CLIP_RANGE), math.log(configured * CLIP_RANGE)
    step = -lr * (share - quantile)  # finite or ±inf, never NaN (lr > 0)
    return math.exp(min(max(math.log(clip) + step, lo), hi))
