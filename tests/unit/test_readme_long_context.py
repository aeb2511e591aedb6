"""The documented long-context example (docs/parallelism.md: CP 4 at seq_len 8192 on CPU) passes
the trainer's pre-flight check on 4 ranks, and the estimate gives each rank a quarter of the
activations."""

import os
import re
import shlex

import torch

from titanlab.planning import preflight
from titanlab.config.manager import build_config
from titanlab.planning.memory import estimate_memory

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def readme_example() -> tuple[int, list[str]]:
    """(NGPU, options) of the first documented command that sets context_parallel_degree."""
    with open(os.path.join(REPO, "docs", "parallelism.md"), encoding="utf-8") as f:
        text = f.read()
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        command = block.replace("\\\n", " ")
        if "context_parallel_degree" in command:
            words = shlex.split(command)
            ngpu = int(words[0].split("=")[1])
            return ngpu, words[words.index("./run_train.sh") + 1 :]
    raise AssertionError("docs/parallelism.md has no context-parallel example")


def test_long_context_example_is_accepted_with_a_quarter_of_the_activations():
    ngpu, options = readme_example()
    config = build_config(
        ["--job.config_file", os.path.join(REPO, "train_configs", "debug_model.toml"), *options]
    )
    assert (ngpu, config.training.seq_len, config.parallelism.context_parallel_degree) == (
        4,
        8192,
        4,
    )
    plan = preflight.check(config, ngpu, ngpu)
    assert plan.parallel_dims.cp == 4
    one = build_config(
        [
            "--job.config_file",
            os.path.join(REPO, "train_configs", "debug_model.toml"),
            *options,
            "--parallelism.context_parallel_degree",
            "1",
        ]
    )
    cp4 = estimate_memory(plan.model_args, config, ngpu, torch.float32)
    cp1 = estimate_memory(plan.model_args, one, 1, torch.float32)
    assert abs(cp4.activations / cp1.activations - 0.25) < 0.01
    # The example takes the fused loss (auto: 2048 tokens a rank are more than a chunk): its
    # head holds one chunk's logits and the weight's gradient, less than the plain head's,
    # whose logits fall to a quarter exactly under CP 4.
    assert cp4.logits < cp1.logits
    for c in (config, one):
        c.loss.fused_linear_cross_entropy = False
    plain4 = estimate_memory(plan.model_args, config, ngpu, torch.float32)
    plain1 = estimate_memory(plan.model_args, one, 1, torch.float32)
    assert abs(plain4.logits / plain1.logits - 0.25) < 0.01
    assert cp4.logits < plain4.logits
