"""Every test that starts a process group ends it through `destroy_distributed`, which waits
for all ranks (a barrier) before tearing gloo down (issue 16: a rank that left while its peer
still sent aborted with SIGABRT and failed a CI run)."""

import os
import re

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_no_test_destroys_a_process_group_directly():
    offenders = []
    for folder, _, files in os.walk(TESTS):
        for name in files:
            if not name.endswith(".py") or name == os.path.basename(__file__):
                continue
            path = os.path.join(folder, name)
            text = open(path, encoding="utf-8").read()
            if re.search(r"\bdestroy_process_group\(", text):
                offenders.append(os.path.relpath(path, TESTS))
            if "init_process_group(" in text and "destroy_distributed(" not in text:
                offenders.append(os.path.relpath(path, TESTS) + " (never ends its group)")
    assert not offenders, offenders
