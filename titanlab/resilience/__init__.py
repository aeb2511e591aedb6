"""Fault handling: the one-line failures and their exit codes (`failures`), preemption and
requeue (`preemption`), and the torchrun wrapper that shows a failing rank's line last
(`launcher`).

May import `config` only.
"""
