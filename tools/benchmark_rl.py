"""GRPO against Hugging Face TRL's `GRPOTrainer` on the same work: seconds per rollout step, the
rollout / train split, tokens/s, and the reward after the run.

    python tools/benchmark_rl.py [--steps 30] [--iterations 4] [--prompts 32] [--group 8]
                                 [--out docs/performance.md]

Both sides start from the same weights: a random (seed 0) transformers `LlamaForCausalLM` of
titanlab's `debugmodel_tiny` shape on the reverse-4-digits vocabulary (16 tokens), saved with a
`tokenizers` word-level tokenizer of the same ids, and imported into titanlab with
`convert_checkpoint from-hf`. Same task (reverse 4 digits, partial-credit reward), G
completions of `--prompts` prompts per step, temperature 1, 5 new tokens, β = 0.04 (k3 KL to the
initial model), ε = 0.2, μ = `--iterations` optimizer steps per rollout, token-mean loss
(TRL's `loss_type="dapo"`), AdamW (lr 3e-3, betas 0.9/0.95, no weight decay, constant),
gradient clip 1.0, fp32.

Rows: titanlab on 2 ranks (torchrun, FSDP 2, one thread per rank), titanlab on 1 rank with 2
threads, and TRL in one process with 2 threads (TRL generates with `model.generate` and its KV
cache; `use_cpu=True`, no vLLM). A step is one rollout and its μ optimizer steps (TRL counts μ
global steps per rollout; they are summed). Seconds per step: the median over the steps after
the first 3; tokens/s: completion tokens sampled (rollout) and prompt + completion tokens trained
(train, × μ) per second of each phase. Reward: the mean partial credit of the sampled
completions, averaged over the last 5 steps. TRL is a benchmark-only dependency
(`pip install 'titanlab[bench]'`); titanlab never imports it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tools.lib import bench
from tools.lib.runs import failure_line

TAG = "rl"
PROMPT_LEN, NEW = 6, 5


def build_hf(out: str) -> None:
    """The shared initial model and its tokenizer, as a Hugging Face folder."""
    import torch
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from titanlab.data.digit_tasks import BOS, EOS, SEP, VOCAB_SIZE
    from titanlab.models.llama3 import llama3_flavors

    args = llama3_flavors["debugmodel_tiny"]
    vocab = {str(d): d for d in range(10)} | {"<bos>": BOS, "<sep>": SEP, "<eos>": EOS,
                                             "<pad>": 13, "<unk>": 14, "<unused>": 15}  # fmt: skip
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        unk_token="<unk>", additional_special_tokens=["<sep>"],
    )  # fmt: skip
    hf_tok.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=args.dim, intermediate_size=args.ffn_hidden_dim(),
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
        num_key_value_heads=args.kv_heads, rms_norm_eps=args.norm_eps, rope_theta=args.rope_theta,
        max_position_embeddings=args.max_seq_len, tie_word_embeddings=False,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=13,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)


def titanlab_row(dcp: str, ranks: int, a: argparse.Namespace, work: str) -> dict:
    dump = os.path.join(work, f"titanlab-{ranks}")
    cmd = [
        os.path.join(REPO, "run_train.sh"), os.path.join(REPO, "train_configs", "grpo_debug.toml"),
        "--model.flavor", "hf", "--checkpoint.initial_load_path", dcp,
        "--checkpoint.enable", "false", "--job.dump_folder", dump,
        "--training.steps", str(a.steps), "--training.local_batch_size",
        str(a.prompts * a.group // ranks), "--rl.group_size", str(a.group),
        "--rl.iterations", str(a.iterations), "--rl.eval_freq", "0", "--metrics.log_freq", "1",
        "--parallelism.data_parallel_shard_degree", str(ranks),
    ]  # fmt: skip
    threads = 1 if ranks > 1 else 2
    env = dict(os.environ, NGPU=str(ranks), OMP_NUM_THREADS=str(threads))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"titanlab run failed: {failure_line(proc.stdout + proc.stderr)}")
    with open(os.path.join(dump, "metrics.jsonl"), encoding="utf-8") as f:
        recs = [json.loads(line) for line in f]
    steps = [r["step_time_ms"] / 1000 for r in recs[3:]]
    rollout = [r["rl/rollout_s"] for r in recs[3:]]
    train = [r["rl/train_s"] for r in recs[3:]]
    name = (
        f"titanlab · {ranks} ranks FSDP · 1 thread each"
        if ranks > 1
        else "titanlab · 1 rank · 2 threads"
    )
    return row(name, steps, rollout, train, [r["rl/reward_mean"] for r in recs], a)


def row(name, steps, rollout, train, rewards, a) -> dict:
    completions = a.prompts * a.group
    roll, tr = statistics.median(rollout), statistics.median(train)
    return {
        "name": name,
        "step_s": statistics.median(steps),
        "rollout_s": roll,
        "train_s": tr,
        "rollout_tps": completions * NEW / roll,
        "train_tps": completions * (PROMPT_LEN + NEW) * a.iterations / tr,
        "reward_first": statistics.mean(rewards[:5]),
        "reward_last": statistics.mean(rewards[-5:]),
    }


def trl_child(hf: str, a: argparse.Namespace) -> None:
    """Run in a child process (TRL imports torch with its own thread count): print the row."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from titanlab.data.digit_tasks import DigitTask, DigitVocab

    torch.manual_seed(0)
    task, vocab = DigitTask("reverse", 4), DigitVocab()
    rng = random.Random(0)
    rows = [task.draw(rng, held_out=False) for _ in range(a.steps * a.prompts)]
    data = Dataset.from_list([{"prompt": vocab.decode(p), "target": m["target"]} for p, m in rows])

    def partial_credit(prompts, completions, completion_ids, target, **_):
        return [
            sum(x == y for x, y in zip(ids, t)) / len(t) for ids, t in zip(completion_ids, target)
        ]

    marks: list[tuple[str, float]] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            marks.append(("begin", time.perf_counter()))

        def on_step_end(self, args, state, control, **kw):
            marks.append(("end", time.perf_counter()))

    completions = a.prompts * a.group
    config = GRPOConfig(
        output_dir=os.path.join(a.work, "trl"), use_cpu=True, bf16=False, report_to="none",
        per_device_train_batch_size=completions, gradient_accumulation_steps=1,
        num_generations=a.group, max_completion_length=NEW, temperature=1.0,
        num_iterations=a.iterations, beta=0.04, epsilon=0.2, loss_type="dapo",
        learning_rate=3e-3, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0, max_steps=a.steps * a.iterations,
        logging_steps=1, save_strategy="no", seed=0, remove_unused_columns=False,
        shuffle_dataset=False, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(a.hf, dtype=torch.float32),
        reward_funcs=partial_credit, args=config, train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(a.hf), callbacks=[Clock()],
    )  # fmt: skip
    trainer.train()
    # A rollout step: the μ global steps that share one generation batch.
    begins = [t for k, t in marks if k == "begin"]
    ends = [t for k, t in marks if k == "end"]
    per = a.iterations
    steps = [ends[i + per - 1] - begins[i] for i in range(0, len(begins) - per + 1, per)]
    # TRL generates inside the first global step of each rollout; the others only train.
    train = [
        sum(ends[j] - begins[j] for j in range(i + 1, i + per))
        for i in range(0, len(begins) - per + 1, per)
    ]
    first = [ends[i] - begins[i] for i in range(0, len(begins), per)]
    # The first step also trains once: count its share as the median of the other train steps.
    one_train = (
        statistics.median([ends[j] - begins[j] for j in range(len(begins)) if j % per])
        if per > 1
        else 0.0
    )
    rollout = [f - one_train for f in first]
    train = [t + one_train for t in train]
    logs = [h for h in trainer.state.log_history if "reward" in h]
    rewards = [logs[i]["reward"] for i in range(0, len(logs), per)]
    print(json.dumps(row("TRL GRPOTrainer · 1 process · 2 threads", steps[3:], rollout[3:],
                         train[3:], rewards, a)))  # fmt: skip


def trl_row(hf: str, a: argparse.Namespace) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, os.path.abspath(__file__), "--trl-child", "--hf", hf, "--work", a.work,
           "--steps", str(a.steps), "--iterations", str(a.iterations), "--prompts",
           str(a.prompts), "--group", str(a.group)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"TRL run failed: {failure_line(proc.stderr)}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def render(rows: list[dict], a: argparse.Namespace, command: str) -> str:
    import torch

    from titanlab.observability.hostinfo import cpu_model, ram_gib

    trl = next(r for r in rows if r["name"].startswith("TRL"))
    lines = [
        f"Machine: {cpu_model()}, {os.cpu_count()} cores, {ram_gib():.0f} GiB RAM; torch "
        f"{torch.__version__}, fp32. Reverse-4-digits, {a.prompts} prompts × G = {a.group} "
        f"completions of {NEW} tokens per step, μ = {a.iterations}, {a.steps} steps, the same "
        "initial weights (method: `tools/benchmark_rl.py`).",
        f"Command: `{command}`",
        "",
        "| run | s / step | vs TRL | rollout s | train s | rollout tokens/s | train tokens/s | "
        "reward, first 5 → last 5 steps |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['step_s']:.3f} | {trl['step_s'] / r['step_s']:.2f}× | "
            f"{r['rollout_s']:.3f} | {r['train_s']:.3f} | {r['rollout_tps']:,.0f} | "
            f"{r['train_tps']:,.0f} | {r['reward_first']:.3f} → {r['reward_last']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--out", default=os.path.join(REPO, "docs", "performance.md"))
    p.add_argument("--trl-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hf", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.trl_child:
        return trl_child(a.hf, a)
    with tempfile.TemporaryDirectory() as work:
        a.work = work
        hf, dcp = os.path.join(work, "hf"), os.path.join(work, "dcp")
        build_hf(hf)
        convert = [sys.executable, os.path.join(REPO, "tools", "convert_checkpoint.py"),
                   "from-hf", hf, dcp, "--quiet"]  # fmt: skip
        subprocess.run(convert, cwd=REPO, check=True, capture_output=True)
        rows = [titanlab_row(dcp, 2, a, work), titanlab_row(dcp, 1, a, work), trl_row(hf, a)]
    command = "python tools/benchmark_rl.py " + shlex.join(sys.argv[1:])
    bench.publish(a.out, TAG, render(rows, a, command.strip()))


if __name__ == "__main__":
    main()
