"""Sample from a checkpoint: `python -m titanlab.generate CHECKPOINT --prompt TEXT [...]`.

CHECKPOINT is a titanlab DCP folder (`checkpoint/step-N`, `export-step-N`, any parallel layout)
or a Hugging Face folder. Prompts come from `--prompt` (repeatable), `--prompt-file` (one per
line) or `--chat` (a JSONL file of `{"messages": [...]}` conversations, rendered with the chat
template and answered as the assistant; `titanlab.data.chat`); several prompts run as one
left-padded batch. Under torchrun
(`torchrun --nproc_per_node N -m titanlab.generate ...`) the model runs tensor parallel over the
N ranks (`titanlab.generation.tensor_parallel`) and rank 0 prints. Greedy by default;
`--temperature`, `--top-k`, `--top-p` and `--seed` sample. `--mtp-draft` drafts with a
DeepSeek-V3 model's multi-token prediction depth (`titanlab.generation.mtp_draft`): same output,
fewer forwards. A single prompt streams its tokens to the terminal; the
last line reports the tokens generated per second. Bad input ends with one line, exit code 2.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from titanlab.config.cli_parser import OneLineParser, positive_int
from titanlab.data.chat import read_chat_jsonl, render_chat_prompt
from titanlab.data.tokenizer import default_tokenizer_path, load_tokenizer
from titanlab.generation import DraftStats, SamplingParams, generate
from titanlab.distributed.init import destroy_distributed, init_distributed
from titanlab.generation.generate import check_request
from titanlab.generation.loading import load_model
from titanlab.generation.tensor_parallel import apply_generation_tp
from titanlab.models.common.kv_cache import KVCache

PROG = "python -m titanlab.generate"


def build_parser(prog: str = PROG) -> OneLineParser:
    p = OneLineParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="DCP folder (step-N, export-step-N) or Hugging Face folder")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompt-file", default="", help="a text file, one prompt per line")
    p.add_argument("--chat", default="", help='a JSONL file, one {"messages": [...]} per line')
    p.add_argument("--tokenizer", default="", help="tokenizer.model / tokenizer.json (default: "
                   "the Hugging Face folder's, else titanlab's bundled one)")  # fmt: skip
    p.add_argument("--max-new-tokens", type=positive_int, default=64,
                   help="tokens to generate per prompt, >= 1 (default 64)")  # fmt: skip
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--top-p", type=float, default=1.0, help="in (0, 1]; 1: off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-bos", action="store_true", help="do not prepend the BOS token")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--mtp-draft", action="store_true", help="decode self-speculatively with the "
                   "model's multi-token prediction depth (DeepSeek-V3): the same output in "
                   "fewer forwards")  # fmt: skip
    return p


def _prompts(args) -> list[str]:
    if args.chat and (args.prompt or args.prompt_file):
        raise ValueError(
            "--chat takes the conversations from its file; drop --prompt / --prompt-file"
        )
    prompts = list(args.prompt)
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            raise ValueError(f"--prompt-file {args.prompt_file!r}: {e.strerror}") from None
    if not prompts and not args.chat:
        raise ValueError("no prompt; give --prompt TEXT, --prompt-file FILE or --chat FILE")
    return prompts


def _tokenizer_path(args) -> str:
    if args.tokenizer:
        return args.tokenizer
    hf = os.path.join(args.checkpoint, "tokenizer.json")
    return hf if os.path.isfile(hf) else default_tokenizer_path()


class _Stdout:
    """Whether the last text printed to stdout left its line open (a streamed continuation
    ends without a newline until it finishes): an error then starts on a line of its own."""

    open_line = False

    @classmethod
    def write(cls, text: str) -> None:
        print(text, end="", flush=True)
        if text:
            cls.open_line = not text.endswith("\n")


def run(argv: list[str], prog: str = PROG) -> int:
    args = build_parser(prog).parse_args(argv)
    params = SamplingParams(args.temperature, args.top_k, args.top_p)
    params.validate()
    prompts = _prompts(args)
    tokenizer = load_tokenizer(_tokenizer_path(args))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    if world > 1:
        device, rank, _ = init_distributed(init_timeout_s=120)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, _, model_args = load_model(args.checkpoint, device, getattr(torch, args.dtype))
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        apply_generation_tp(model, init_device_mesh(device.type, (world,)))
    if tokenizer.vocab_size > model_args.vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer.path!r} has {tokenizer.vocab_size} tokens but the model only "
            f"{model_args.vocab_size}; give the tokenizer it was trained with (--tokenizer)"
        )
    eos_ids = [tokenizer.eos_id]
    if args.chat:
        chats = [render_chat_prompt(tokenizer, m) for m in read_chat_jsonl(args.chat)]
        ids = [c.ids for c in chats]
        prompts = [tokenizer.decode(i) for i in ids]
        eos_ids += [e for c in chats[:1] for e in c.stop_ids if e not in eos_ids]
    else:
        ids = [tokenizer.encode(p, bos=not args.no_bos, eos=False) for p in prompts]
    # every refusal before the first word is printed
    check_request(model, ids, args.max_new_tokens, params, mtp_draft=args.mtp_draft)
    stream = len(prompts) == 1 and rank == 0
    shown: list[int] = []

    def on_step(new: list[int | None]) -> None:
        if stream and new[0] is not None:
            before = tokenizer.decode(shown)
            shown.append(new[0])
            _Stdout.write(tokenizer.decode(shown)[len(before) :])

    if stream:
        _Stdout.write(prompts[0])
    draft = DraftStats() if args.mtp_draft else None
    caches: list[KVCache] = []
    begin = time.perf_counter()
    out = generate(
        model, ids, args.max_new_tokens, params=params, eos_ids=eos_ids,
        seed=args.seed, on_step=on_step, mtp_draft=draft, cache_out=caches,
    )  # fmt: skip
    seconds = time.perf_counter() - begin
    if rank != 0:
        return 0
    if stream:
        _Stdout.write("\n")
    else:
        for prompt, new in zip(prompts, out):
            print(prompt + tokenizer.decode(new))
            print("---")
    total = sum(map(len, out))
    if draft is not None:
        print(
            f"MTP draft: {draft.accepted} of {draft.drafted} drafts accepted "
            f"({100 * draft.acceptance:.0f}%), {draft.emitted} tokens per sequence in "
            f"{draft.forwards + 1} forwards",
            file=sys.stderr,
        )
    if caches:
        print(cache_line(caches[0], len(prompts)), file=sys.stderr)
    print(
        f"generated {total} tokens for {len(prompts)} prompt(s) in {seconds:.2f}s: "
        f"{total / seconds:.1f} tokens/s ({device.type}, {args.dtype})",
        file=sys.stderr,
    )
    return 0


def cache_line(cache: KVCache, sequences: int) -> str:
    """The cache's memory per sequence: keys and values (grow with the context: allocated for
    `max_seq_len` slots) and, for a model that has them, linear-attention states (constant in
    it); this rank's share under tensor parallel."""
    kib = 1024 * sequences
    line = f"cache per sequence: {cache.kv_bytes() / kib:.1f} KiB keys/values for {cache.max_seq_len} slots"
    if cache.recurrent_bytes():  # a model with linear-attention layers (Qwen3.5's)
        line += f", {cache.recurrent_bytes() / kib:.1f} KiB linear-attention state (constant in the context)"
    return line


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """Generate (see the module); `prog` names the program in usage lines. Bad input is one
    `titanlab: error:` line (the prefix of every titanlab command), exit code 2."""
    clean = False
    _Stdout.open_line = False
    try:
        code = run(sys.argv[1:] if argv is None else argv, prog)
        clean = True
        return code
    except (ValueError, FileNotFoundError) as e:
        if _Stdout.open_line:  # the error begins its own line, not the streamed text's
            _Stdout.write("\n")
        print(f"titanlab: error: {e}", file=sys.stderr)
        return 2
    finally:
        destroy_distributed(barrier=clean)
