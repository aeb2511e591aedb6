"""Metrics of a run: the log line, metrics.jsonl, TensorBoard and W&B records, MFU.

May import `config` and `data`.
"""

from titanlab.metrics.flops import device_peak_flops
from titanlab.metrics.format import format_moe, parse_log_line
from titanlab.metrics.logger import MetricsLogger
from titanlab.metrics.system import rss_bytes

__all__ = ["MetricsLogger", "device_peak_flops", "format_moe", "parse_log_line", "rss_bytes"]
