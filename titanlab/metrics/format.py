"""The metrics line: writing it and parsing it back.

The line reads `step: N  loss: X  grad_norm: G  lr: L  tps: T  tflops: F  mfu: M%  memory: ...`
followed by the step-time spread and CPU use, so tools and tests can parse the first fields
(`parse_log_line`).
"""

from __future__ import annotations

import re
from typing import Any

_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))")


def parse_log_line(line: str) -> tuple[int, float] | None:
    """(step, loss) from a metrics line, or None when the line is not one."""
    m = _LINE.search(line)
    return (int(m.group(1)), float(m.group(2))) if m else None


def format_line(rec: dict[str, Any], memory_kind: str) -> str:
    """The log line of one metrics record (see `MetricsLogger.log` for its keys)."""
    mfu = f"{rec['mfu_pct']:.2f}%" if "mfu_pct" in rec else "n/a"
    line = (
        f"step: {rec['step']}  loss: {rec['loss']:.6f}  grad_norm: {rec['grad_norm']:.4f}  "
        f"lr: {rec['lr']:.3e}  tps: {rec['tps']:.0f}  tflops: {rec['tflops']:.3f}  mfu: {mfu}  "
        f"memory: {rec['memory_gib']:.2f}GiB({memory_kind})  "
        f"step_ms: {rec['step_time_ms']:.1f} ({rec['step_time_ms_min']:.1f}–"
        f"{rec['step_time_ms_max']:.1f})  data_ms: {rec['data_wait_ms']:.1f}  "
        f"cpu: {rec['cpu_util_pct']:.0f}%"
    )
    if "mtp_loss" in rec:  # multi-token prediction depths (DeepSeek-V3)
        line += f"  mtp_loss: {rec['mtp_loss']:.6f}"
    if "loss_scale" in rec:
        line += f"  loss_scale: {rec['loss_scale']:g}"
    if "muon/ns_gflop" in rec:  # this rank's Newton-Schulz work of the step (Muon)
        line += f"  muon_ns_gflop: {rec['muon/ns_gflop']:.2f}"
    if rec.get("alloc_retries"):
        line += f"  alloc_retries: {rec['alloc_retries']:.0f}"
    if "ft/groups" in rec:  # fault tolerance: the replica groups in this step's quorum
        line += f"  groups: {rec['ft/groups']:.0f}"
    return line


def format_moe(extra: dict[str, float]) -> str:
    """The expert-load line: the mean aux loss, then per MoE layer max/mean token slots per
    expert (1.00 is perfect balance) and the bias norm where auxiliary-loss-free balancing is on."""
    parts = []
    if "moe/aux_loss" in extra:
        parts.append(f"moe_aux_loss: {extra['moe/aux_loss']:.5f}")
    layers = sorted({k.split("/")[1] for k in extra if k.count("/") == 2}, key=_layer_key)
    loads = []
    for layer in layers:
        mean = extra.get(f"moe/{layer}/mean_load", 0.0)
        ratio = extra.get(f"moe/{layer}/max_load", 0.0) / mean if mean else 0.0
        bias = extra.get(f"moe/{layer}/bias_norm")
        loads.append(f"{layer}:{ratio:.2f}" + (f"(bias {bias:.3f})" if bias is not None else ""))
    if loads:
        parts.append("expert max/mean load: " + " ".join(loads))
    return "  ".join(parts)


def format_qk_clip(extra: dict[str, float]) -> str:
    """MuonClip's line: each layer's largest pre-softmax logit of the step (before the clip)
    and the heads rescaled."""
    layers = sorted(
        (int(k.split("/")[1][6:]), v) for k, v in extra.items() if k.startswith("qk_clip/layer.")
    )
    per_layer = " ".join(f"{i}:{v:.2f}" for i, v in layers)
    return (
        f"max_logit: {extra['qk_clip/max_logit']:.3f} (per layer {per_layer})  "
        f"clipped_heads: {extra['qk_clip/clipped_heads']:.0f}"
    )


def format_rl(extra: dict[str, float]) -> str:
    """The reinforcement-learning line: rewards (mean ± std, then per function), groups with
    equal rewards, completion length, KL, clip fractions, ratio max, the largest sampler vs
    trainer log-probability gap, the rollout's share of the step, and the held-out evaluation."""
    r = {k[3:]: v for k, v in extra.items() if k.startswith("rl/")}
    if "dpo_reward_accuracy" in r:
        return format_dpo(r)
    parts = [f"reward: {r['reward_mean']:.4f}±{r['reward_std']:.4f}"]
    per_fn = [f"{k[7:]} {v:.4f}" for k, v in r.items() if k.startswith("reward/")]
    if per_fn:
        parts[0] += f" ({', '.join(per_fn)})"
    parts.append(f"zero_std_groups: {r['frac_zero_std_groups']:.2f}")
    parts.append(
        f"len: {r['completion_len_mean']:.1f}/{r['completion_len_max']:.0f} "
        f"(truncated {r['truncated_frac']:.2f})"
    )
    if "kl" in r:
        parts.append(f"kl: {r['kl']:.4f}")
    if "value_loss" in r:  # PPO
        parts.append(f"value: {r['value_mean']:.4f} (loss {r['value_loss']:.5f})")
    parts.append(f"clip: {r['clip_low_frac']:.3f}/{r['clip_high_frac']:.3f}")
    parts.append(f"ratio_max: {r['ratio_max']:.3f}")
    parts.append(f"sampler_dlogp: {r['sampler_logp_max_diff']:.1e}")
    total = r["rollout_s"] + r["train_s"]
    parts.append(f"rollout: {100 * r['rollout_s'] / total if total else 0:.0f}%")
    if "eval_exact_match" in r:
        parts.append(
            f"eval: reward {r.get('eval_reward', 0.0):.3f} exact {r['eval_exact_match']:.3f} "
            f"partial {r['eval_partial_credit']:.3f}"
        )
    return "  ".join(parts)


def format_dpo(r: dict[str, float]) -> str:
    """DPO's line: implicit rewards of the chosen and rejected completions, the share of pairs
    ranked right, the margin, and the held-out accuracy."""
    line = (
        f"rewards: chosen {r['dpo_reward_chosen']:.4f} rejected {r['dpo_reward_rejected']:.4f}  "
        f"accuracy: {r['dpo_reward_accuracy']:.3f}  margin: {r['dpo_reward_margin']:.4f}"
    )
    if "eval_reward_accuracy" in r:
        line += (
            f"  eval: accuracy {r['eval_reward_accuracy']:.3f} margin {r['eval_reward_margin']:.4f}"
        )
    return line


def _layer_key(layer: str) -> tuple[int, str]:
    return (int(layer), "") if layer.isdigit() else (1 << 30, layer)


def format_mixture(tokens: dict[str, int]) -> str:
    """`data: web 70.0% (1,120,000 tokens), code 30.0% (480,000 tokens)`: each source's share
    of the tokens consumed so far."""
    total = sum(tokens.values()) or 1
    parts = [f"{name} {100 * n / total:.1f}% ({n:,} tokens)" for name, n in tokens.items()]
    return "data: " + ", ".join(parts)
