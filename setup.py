"""Packaging beyond what pyproject.toml can say: the wheel ships the training configs.

`train_configs/` stays at the top of the checkout (run_train.sh, the docs and the tests name it
there); the package `titanlab.train_configs` is mapped onto it, so `pip install .` and
`python -m build` copy its `*.toml` files (pyproject's package-data) into the installed package
as `titanlab/train_configs/`, where `titanlab.config.shipped` finds them. Everything else is in
pyproject.toml.
"""

from setuptools import find_namespace_packages, setup

setup(
    packages=[*find_namespace_packages(include=["titanlab*"]), "titanlab.train_configs"],
    package_dir={"titanlab.train_configs": "train_configs"},
)
