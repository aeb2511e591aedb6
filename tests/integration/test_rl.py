"""GRPO, PPO and DPO end to end on CPU ranks: from random init, 2 ranks learn reverse-4-digits
to a greedy held-out exact match >= 0.9 within 200 steps (GRPO), raise the mean reward by >= 0.3
within 70 (PPO), and rank held-out preference pairs right more than 90% of the time (DPO): those curves run in `make test-full`; CI runs each
one's first steps with a bound a broken learner misses (GRPO's reward +0.15 by steps 21-30,
PPO's +0.1, DPO's held-out accuracy > 0.55 at step 25). A GRPO run killed with SIGKILL resumes
with the same rewards and losses, bit for bit, and so does a GRPO run on JSONL prompts. One
update on fixed data under every layout: tests/integration/test_rl_layouts.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess

import pytest

from conftest import REPO, run_config, wait_for, worker_pid
from titanlab.checkpoint import store

CONFIG = os.path.join(REPO, "train_configs", "grpo_debug.toml")
DPO_CONFIG = os.path.join(REPO, "train_configs", "dpo_debug.toml")
PPO_CONFIG = os.path.join(REPO, "train_configs", "ppo_debug.toml")
QUIET = ["--comm.init_timeout_seconds", "120", "--comm.train_timeout_seconds", "120",
         "--debug.deterministic", "true"]  # fmt: skip
FULL_ONLY = pytest.mark.skipif(
    os.environ.get("TITANLAB_PARITY_FULL") != "1", reason="make test-parity-full runs it"
)


def records(dump: str) -> dict[int, dict]:
    """metrics.jsonl by step (the last record of a step wins)."""
    with open(os.path.join(dump, "metrics.jsonl"), encoding="utf-8") as f:
        return {rec["step"]: rec for rec in map(json.loads, f)}


def start(
    dump: str, *extra: str, env_extra: dict | None = None, config: str = CONFIG
) -> subprocess.Popen:
    """`run_train.sh train_configs/grpo_debug.toml` (or `config`) on 2 ranks, a record every
    step."""
    env = dict(os.environ, NGPU="2", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env_extra or {}))
    cmd = [os.path.join(REPO, "run_train.sh"), config, *QUIET, "--metrics.log_freq", "1",
           "--job.dump_folder", dump, *extra]  # fmt: skip
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


SHORT = ["--training.steps", "30", "--rl.eval_freq", "0"]
"""CI's GRPO run: the shipped config's first 30 steps (constant LR: the same steps as the 200)."""


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict[int, dict]:
    """The records of train_configs/grpo_debug.toml's first 30 steps (2 warm ranks from random
    init, no held-out evaluation): what the kill test resumes to, and CI's learning check."""
    dump = str(tmp_path_factory.mktemp("grpo30"))
    run_config(CONFIG, *QUIET, "--metrics.log_freq", "1", "--job.dump_folder", dump,
               "--checkpoint.enable", "false", *SHORT, timeout=900).check()  # fmt: skip
    return records(dump)


def mean_reward(got: dict[int, dict], first: int, last: int) -> float:
    return sum(got[s]["rl/reward_mean"] for s in range(first, last + 1)) / (last - first + 1)


@pytest.mark.cover("learns:grpo")
def test_grpo_raises_the_sampled_reward_within_30_steps(straight):
    """CI's short form of the learning curve below: from random init the sampled completions'
    mean reward over steps 21-30 is at least 0.15 above steps 1-10 (measured on a 2-core Intel
    Xeon VM: 0.101 → 0.393); a policy gradient of the wrong sign, a zero advantage or a
    sampler out of step with the trainer keeps it flat or lowers it."""
    early, late = mean_reward(straight, 1, 10), mean_reward(straight, 21, 30)
    print(f"\nGRPO sampled reward: steps 1-10 {early:.3f} → steps 21-30 {late:.3f}")
    assert late >= early + 0.15
    assert straight[30]["rl/sampler_logp_max_diff"] < 1e-4  # same module, same kernels


@pytest.fixture(scope="module")
def learned(tmp_path_factory) -> dict[int, dict]:
    """The records of train_configs/grpo_debug.toml as shipped (2 warm ranks from random init, as
    run_train.sh trains it; 200 steps, a greedy held-out evaluation every 25 steps). Measured: >= 0.9 by step 100 on an
    Intel Xeon VM (0.94), by step 125 on an AMD EPYC one (0.81 at 100): the CPU's kernels change
    the trajectory, so the test holds the issue's bound, 200 steps."""
    dump = str(tmp_path_factory.mktemp("grpo"))
    run_config(CONFIG, *QUIET, "--metrics.log_freq", "1", "--job.dump_folder", dump,
               "--checkpoint.enable", "false", timeout=900).check()  # fmt: skip
    return records(dump)


@FULL_ONLY
@pytest.mark.cover("learns:grpo")
def test_grpo_learns_reverse_digits_from_random_init_on_two_ranks(learned):
    evals = {s: r["rl/eval_exact_match"] for s, r in learned.items() if "rl/eval_exact_match" in r}
    first = min((s for s, v in evals.items() if v >= 0.9), default=None)
    print(
        f"\ngreedy held-out exact match by step: {evals}; first >= 0.9 at step {first}; "
        f"sampled reward {learned[1]['rl/reward_mean']:.3f} → {learned[200]['rl/reward_mean']:.3f}"
    )
    assert evals[25] < 0.5  # it starts from nothing
    assert first is not None and first <= 200
    assert evals[200] >= 0.9
    assert learned[200]["rl/reward_mean"] > learned[1]["rl/reward_mean"] + 0.5
    assert learned[200]["rl/sampler_logp_max_diff"] < 1e-4  # same module, same kernels


def test_sigkill_mid_run_resumes_with_the_same_rewards_and_losses_bit_for_bit(straight, tmp_path):
    """Rank 1 is killed with SIGKILL after the step-10 checkpoint; torchrun restarts the group,
    which resumes from its newest complete checkpoint (policy, optimizer, prompt stream; the
    reference is rebuilt from the seed, the sampler reseeded per step) and runs to step 30:
    every record equals the
    uninterrupted run's (`straight`)."""
    dump = str(tmp_path / "killed")
    run = start(dump, "--training.steps", "30", "--rl.eval_freq", "0", "--checkpoint.interval",
                "10", "--checkpoint.keep_latest_k", "0", "--checkpoint.export_at_end", "false",
                env_extra={"MAX_RESTARTS": "1"})  # fmt: skip
    step10 = os.path.join(dump, "checkpoint", "step-10")
    wait_for(lambda: os.path.isdir(step10) and store.incomplete_reason(step10) is None, 600)
    os.kill(worker_pid(1, dump), signal.SIGKILL)
    out, _ = run.communicate(timeout=600)
    assert run.returncode == 0, out[-4000:]
    assert "restart 1" in out  # the group really restarted
    got = records(dump)
    keys = ("loss", "grad_norm", "rl/reward_mean", "rl/reward_std", "rl/kl",
            "rl/completion_len_mean")  # fmt: skip
    assert sorted(got) == list(range(1, 31))
    for step in range(1, 31):
        assert {k: got[step][k] for k in keys} == {k: straight[step][k] for k in keys}, step


def test_grpo_on_jsonl_prompts_trains_and_resumes_bit_for_bit(tmp_path):
    """GRPO on a JSONL file of `{"prompt", "answer"}` lines of different lengths, rendered with
    the chat template of the test tokenizer, scored by a test reward (which checks each
    prompt's text and metadata) and math-verify's checker: 6 steps on 2 FSDP ranks, then a
    resume from the step-3 checkpoint gives steps 4-6 bit for bit (the JSONL stream's
    position is checkpointed)."""
    import random

    rng = random.Random(0)
    rows = [(rng.randrange(10 ** rng.randrange(1, 4)), rng.randrange(1000)) for _ in range(40)]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b),
                                        "source": "test"}) + "\n" for a, b in rows))  # fmt: skip
    args = ["--rl.data_path", str(data), "--rl.max_new_tokens", "8", "--rl.group_size", "4",
            "--training.local_batch_size", "8", "--training.seq_len", "48", "--training.steps",
            "6", "--rl.rewards", "rl_text_rewards:length,titanlab.posttrain.rl.math_reward:"
            "math_answer", "--rl.eval_freq", "3", "--rl.eval_prompts", "3",
            "--checkpoint.interval", "3", "--checkpoint.keep_latest_k", "0"]  # fmt: skip
    env = {"PYTHONPATH": os.path.join(REPO, "tests", "integration")}
    full = str(tmp_path / "full")
    out, _ = start(full, *args, env_extra=env).communicate(timeout=600)
    assert "training: done at step 6" in out, out[-4000:]
    resumed = str(tmp_path / "resumed")
    os.makedirs(os.path.join(resumed, "checkpoint"))
    shutil.copytree(os.path.join(full, "checkpoint", "step-3"),
                    os.path.join(resumed, "checkpoint", "step-3"))  # fmt: skip
    out, _ = start(resumed, *args, env_extra=env).communicate(timeout=600)
    assert "training: done at step 6" in out, out[-4000:]
    a, b = records(full), records(resumed)
    keys = ["loss", "grad_norm", "rl/reward_mean", "rl/reward/length", "rl/reward/math_answer",
            "rl/completion_len_mean", "rl/eval_reward"]  # fmt: skip
    print(f"\nJSONL GRPO: reward by step {[round(a[s]['rl/reward_mean'], 4) for s in range(1, 7)]}")
    assert min(b) == 4 and all(a[s].get(k) == b[s].get(k) for s in (4, 5, 6) for k in keys)
    assert "rl/eval_reward" in b[6] and "rl/reward/math_answer" in b[4]
    assert any(a[s]["grad_norm"] > 0 for s in range(1, 7))  # length varies: groups have signal


@pytest.mark.cover("learns:dpo")
def test_dpo_ranks_most_held_out_pairs_right_within_25_steps(tmp_path):
    """CI's short form of the test below: train_configs/dpo_debug.toml's first 25 steps (its
    first held-out evaluation): from 0 (the policy is the reference) the held-out accuracy
    exceeds 0.55 and the reward margin 0.1 (measured on a 2-core Intel Xeon VM: 0.664 and
    0.222); a loss of the wrong sign ranks them wrong."""
    dump = str(tmp_path / "dpo")
    run_config(DPO_CONFIG, *QUIET, "--job.dump_folder", dump, "--checkpoint.enable", "false",
               "--training.steps", "25", "--metrics.log_freq", "5").check()  # fmt: skip
    got = records(dump)
    print(f"\nDPO at step 25: held-out accuracy {got[25]['rl/eval_reward_accuracy']:.3f}, "
          f"margin {got[25]['rl/dpo_reward_margin']:.3f}")  # fmt: skip
    assert got[1]["rl/dpo_reward_accuracy"] == 0.0  # policy = reference: all rewards 0
    assert got[25]["rl/eval_reward_accuracy"] > 0.55
    assert got[25]["rl/dpo_reward_margin"] > 0.1


@FULL_ONLY
@pytest.mark.cover("learns:dpo")
def test_dpo_ranks_held_out_pairs_right_after_training_from_random_init(tmp_path):
    """train_configs/dpo_debug.toml as shipped (2 warm ranks, 100 steps): the held-out pairs' chosen
    completion gets the higher implicit reward more than 90% of the time, from 0 (at the
    reference every reward is 0: no pair is ranked right)."""
    dump = str(tmp_path / "dpo")
    run = run_config(DPO_CONFIG, *QUIET, "--job.dump_folder", dump, "--checkpoint.enable",
                     "false").check()  # fmt: skip
    got = records(dump)
    evals = {
        s: r["rl/eval_reward_accuracy"] for s, r in got.items() if "rl/eval_reward_accuracy" in r
    }
    print(
        f"\nheld-out reward accuracy by step: {evals}; train accuracy "
        f"{got[1]['rl/dpo_reward_accuracy']:.3f} → {got[100]['rl/dpo_reward_accuracy']:.3f}"
    )
    assert got[1]["rl/dpo_reward_accuracy"] == 0.0  # policy = reference: all rewards 0
    assert evals[100] > 0.9
    assert got[100]["rl/dpo_reward_margin"] > 0.5
    out = run.stdout + run.stderr
    assert "held-out:    reward accuracy" in out and "(accuracy)" in out  # the run summary


@pytest.mark.parametrize(
    "steps, gain",
    [
        # CI: measured +0.185 by steps 21-30 on a 2-core Intel Xeon VM
        (30, 0.1),
        # make test-full: measured +0.36 by step 60, +0.53 by 100 (+0.42 over 61-70 on the Xeon)
        pytest.param(70, 0.3, marks=FULL_ONLY),
    ],
)
@pytest.mark.cover("learns:ppo")
def test_ppo_raises_the_mean_reward_from_random_init(tmp_path, steps, gain):
    """train_configs/ppo_debug.toml on 2 warm ranks, cut to its first `steps` of 200 (constant
    LR: the first steps are the same): the sampled completions' mean reward over the last 10
    steps is at least `gain` above steps 1-10."""
    dump = str(tmp_path / "ppo")
    run_config(PPO_CONFIG, *QUIET, "--metrics.log_freq", "1", "--job.dump_folder", dump,
               "--checkpoint.enable", "false", "--training.steps", str(steps),
               timeout=900).check()  # fmt: skip
    got = records(dump)
    first, last = mean_reward(got, 1, 10), mean_reward(got, steps - 9, steps)
    print(
        f"\nPPO mean reward: steps 1-10 {first:.3f} → steps {steps - 9}-{steps} {last:.3f} "
        f"(+{last - first:.3f}); value loss {got[1]['rl/value_loss']:.4f} → "
        f"{got[steps]['rl/value_loss']:.4f}"
    )
    assert last - first >= gain
    assert got[steps]["rl/sampler_logp_max_diff"] < 1e-4
