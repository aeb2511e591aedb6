"""Test-only: makes the ranks of one replica group late (tests/integration/ft_runs.py,
`late_group`). Python imports this module at start-up when its folder is on PYTHONPATH. In a
trainer rank (LOCAL_RANK set, so not torchrun's agent or the launcher) of the group
$TITANLAB_TEST_LATE_GROUP it sleeps $TITANLAB_TEST_LATE_SECONDS: at once, as a group on a
slower node or still importing torch would start; or, with $TITANLAB_TEST_LATE_STEP = N,
before the group asks for step N's quorum (`ReplicaGroup.start_step`), as a group that fell
behind would ask."""

import importlib.abc
import importlib.machinery
import os
import sys
import time

_GROUP = os.environ.get("TITANLAB_TEST_LATE_GROUP")
_SECONDS = float(os.environ.get("TITANLAB_TEST_LATE_SECONDS", "5"))
_STEP = int(os.environ.get("TITANLAB_TEST_LATE_STEP", "0"))
_MODULE = "titanlab.resilience.replica_group"


def _in_late_group() -> bool:
    with open("/proc/self/cmdline", "rb") as f:
        argv = f.read().decode(errors="replace").split("\0")
    option = "--fault_tolerance.replica_id"
    return option in argv and argv[argv.index(option) + 1] == _GROUP


class _LateQuorum(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Loads `_MODULE` as usual, then wraps `ReplicaGroup.start_step` with the sleep."""

    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        self._loader.exec_module(module)
        start_step = module.ReplicaGroup.start_step

        def late_start_step(group):
            if group.trainer_step() + 1 == _STEP:
                time.sleep(_SECONDS)
            return start_step(group)

        module.ReplicaGroup.start_step = late_start_step


if _GROUP is not None and "LOCAL_RANK" in os.environ and _in_late_group():
    if _STEP:
        sys.meta_path.insert(0, _LateQuorum())
    else:
        time.sleep(_SECONDS)
