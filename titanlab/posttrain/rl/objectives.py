"""The arithmetic of GRPO: completion masks, group advantages, the clipped surrogate, k3 KL and
their aggregation. Pure tensor functions, no process group; shapes use B completions of at most
N tokens and G completions per prompt (B = prompts × G, each group contiguous).

Sources: DeepSeekMath (Shao et al. 2024, arXiv:2402.03300) §4.1 eq. 3 (objective), eq. 4 (k3
KL), §4.1.2 (outcome advantages); PPO's clip (Schulman et al. 2017, arXiv:1707.06347); DAPO's
clip-higher, token-mean loss and dynamic sampling (Yu et al. 2025, arXiv:2503.14476); Dr. GRPO's
unscaled advantages (Liu et al. 2025, arXiv:2503.20783).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

LOG_RATIO_LIMIT = 20.0  # |log π_θ/π_old| and |log π_ref/π_θ| clamp: exp stays finite
STD_EPS = 1e-6


def completion_mask(
    completions: torch.Tensor, stop_ids: int | Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which sampled tokens count, by position: every token up to and including the first stop
    token (EOS, or any of `stop_ids`).

    Tokens after it are padding whatever their id (padding may itself be EOS), so the mask is
    never inferred from the token ids after the first stop token.

    Args:
        completions: (B, N) int64 sampled tokens.
    Returns:
        (mask (B, N) bool, truncated (B,) bool: no stop token within the N tokens).
    """
    n = completions.shape[1]
    index = torch.arange(n, device=completions.device)
    ids = [stop_ids] if isinstance(stop_ids, int) else list(stop_ids)
    stops = torch.isin(completions, torch.tensor(ids, device=completions.device))
    first_stop = torch.where(stops, index, n).min(dim=1).values  # (B,)
    return index[None, :] <= first_stop[:, None], first_stop == n


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outcome advantages Â_i = (r_i − mean(group)) / (std(group) + 1e-6), or r_i − mean with
    `scale=False` (Dr. GRPO); std is the unbiased sample std, as TRL and verl compute it.

    A group whose rewards are all equal gets exactly 0 (no float residue of the mean is ever
    divided by a near-zero std).

    Args:
        rewards: (B,) float32, B a multiple of `group_size`, each group contiguous.
    Returns:
        (advantages (B,) float32, zero_std (B // group_size,) bool: the groups with equal rewards).
    """
    r = rewards.float().view(-1, group_size)
    zero_std = (r == r[:, :1]).all(dim=1)
    centred = r - r.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (r.std(dim=1, keepdim=True) + STD_EPS)
    return torch.where(zero_std[:, None], 0.0, centred).flatten(), zero_std


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π_θ ‖ π_ref): exp(x) − x − 1 with x = log π_ref − log π_θ
    (DeepSeekMath eq. 4; Schulman 2020, http://joschu.net/blog/kl-approx.html). ≥ 0, and exactly
    0 where the two agree; x is clamped to ±20. Same shape as the inputs, float32."""
    x = (ref_logp.float() - logp.float()).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return (torch.expm1(x) - x).clamp(min=0.0)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature)[target] per position, in float32, without a full
    log-softmax copy.

    Args:
        logits: (B, S, V) any float dtype; targets: (B, S) int64.
    Returns:
        (B, S) float32.
    """
    flat = (logits.float() / temperature).flatten(0, 1)
    return -F.cross_entropy(flat, targets.flatten(), reduction="none").view(targets.shape)


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token −min(ρ·Â, clip(ρ, 1 − ε_low, 1 + ε_high)·Â) with ρ = π_θ / π_old.

    Args:
        logp: (B, N) float32 log π_θ (with grad); old_logp: (B, N) log π_old (no grad);
        advantages: (B,) one value per completion (GRPO), or (B, N) per token (PPO).
    Returns:
        (loss (B, N) float32, ratio (B, N) detached).
    """
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    clipped = ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high)
    return -torch.minimum(ratio * adv, clipped * adv), ratio.detach()


def aggregate_sum(per_token: torch.Tensor, mask: torch.Tensor, per_sequence: bool) -> torch.Tensor:
    """This rank's share of the loss numerator: Σ over masked tokens (token mean), or Σ over
    completions of each one's masked token mean (sequence mean). Masked-out positions are
    selected away (not multiplied by 0), so a non-finite value there cannot leak.

    Divide by the global count of masked tokens (token mean) or of completions (sequence mean).
    """
    kept = torch.where(mask, per_token, 0.0)
    if not per_sequence:
        return kept.sum()
    return (kept.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum()


def clip_fractions(
    ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Counts (not fractions: summed over ranks first) of masked tokens clipped below (ratio <
    1 − ε_low with Â < 0) and above (ratio > 1 + ε_high with Â > 0): the tokens whose gradient
    the clip removes."""
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    low = ((ratio < 1 - eps_low) & (adv < 0) & mask).sum()
    high = ((ratio > 1 + eps_high) & (adv > 0) & mask).sum()
    return low.float(), high.float()


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016, arXiv:1506.02438, eq. 16):
    δ_t = r_t + γ V_{t+1} − V_t, Â_t = Σ_l (γλ)^l δ_{t+l}, over each completion's counted
    tokens (`mask`, a prefix of each row: V after the last counted token is 0).

    Args:
        rewards: (B, N) float32 per token.
        values: (B, N) float32 per token.
        mask: (B, N) bool.
    Returns:
        (advantages (B, N), returns = advantages + values (B, N)), 0 where `mask` is False.
    """
    n = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(n)):
        following = values[:, t + 1] * mask[:, t + 1] if t + 1 < n else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * following - values[:, t]
        running = torch.where(mask[:, t], delta + gamma * lam * running, 0.0)
        advantages[:, t] = running
    returns = torch.where(mask, advantages + values, 0.0)
    return advantages, returns


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> torch.Tensor:
    """PPO's clipped value loss per token: ½ max((V − R)², (V_old + clip(V − V_old, ±clip) −
    R)²) (the PPO2 baselines; TRL's `cliprange_value`). (B, N) float32."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
