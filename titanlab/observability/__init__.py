"""What a run shows about itself beyond the metrics line (`titanlab.metrics`): the profiler and
memory snapshots (`profiling`), the end-of-run summary and plots, host facts, and the filters
that keep unactionable warnings off the terminal.

May import the packages below `trainer` that hold no run state: `config`, `data`, `metrics`.
"""
