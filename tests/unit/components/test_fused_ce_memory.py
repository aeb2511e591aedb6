"""The fused loss's memory, measured: one LoRA training step of a model with a 32k-vocabulary head
on 1024 tokens, in a fresh process each way; the peak resident memory the step adds falls by at
least the size of the fp32 logits (128 MiB) with the fused loss."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = r"""
import dataclasses, json, sys
import torch
from titanlab.components.fused_head import fused_targets, use_fused_loss
from titanlab.components.loss import cross_entropy_sum
from titanlab.config.peft import Peft
from titanlab.models.registry import build_model, get_family, get_flavor
from titanlab.peft.lora import apply_lora

fused = sys.argv[1] == "fused"
torch.set_num_threads(1)
args = dataclasses.replace(get_flavor(get_family("llama3"), "debugmodel_tiny"),
                           vocab_size=32768, max_seq_len=1024)
torch.manual_seed(0)
model = build_model(args)
model.init_weights()
apply_lora(model, Peft(method="lora", rank=8, alpha=16.0, target_modules=["wq", "wv"]))
if fused:
    use_fused_loss(model, chunk_size=128)
tokens = torch.randint(0, 32768, (1, 1024))
labels = torch.randint(0, 32768, (1, 1024))
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
def status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
# The peak so far includes the transients of building the model: reset it to the current
# resident size (Linux: writing 5 to clear_refs resets VmHWM), so the step's own peak shows.
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status_kib("VmRSS")
if fused:
    with fused_targets(model, labels):
        loss = model(tokens)
else:
    loss = cross_entropy_sum(model(tokens), labels)
loss.backward()
optimizer.step()
after = status_kib("VmHWM")
print(json.dumps({"added_kib": after - before, "loss": loss.item()}))
"""


def step(kind: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", SCRIPT, kind], capture_output=True, text=True,
                         env=env, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_lora_step_with_a_32k_head_saves_at_least_the_logits():
    plain, fused = step("plain"), step("fused")
    logits_mib = 1024 * 32768 * 4 / 2**20
    saved_mib = (plain["added_kib"] - fused["added_kib"]) / 1024
    print(f"\npeak RSS added by one LoRA step (1024 tokens, vocab 32768): plain "
          f"{plain['added_kib'] / 1024:.0f} MiB, fused {fused['added_kib'] / 1024:.0f} MiB; "
          f"saved {saved_mib:.0f} MiB (the fp32 logits: {logits_mib:.0f} MiB)")  # fmt: skip
    assert abs(plain["loss"] - fused["loss"]) / 1024 < 1e-5  # the same mean loss
    assert saved_mib >= logits_mib
