"""The code the scripts in tools/ share: running the trainer (`runs`), the benchmark rows and doc
blocks (`bench`), the feature-pair matrix (`feature_matrix`, `feature_verdicts`, `feature_covering`,
`feature_runs`), a parity layout against one process (`parity_runs`), the closed forms of
communication (`comm_predict`) and the GPU report (`gpu_report`).

tools/*.py are scripts: each imports titanlab and tools.lib, never another script, and nothing
in tools.lib imports a script (tests/unit/test_architecture.py keeps it so).
"""
