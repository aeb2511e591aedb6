"""Convert checkpoints between titanlab DCP and Hugging Face (safetensors), streamed.

    titanlab convert to-hf DCP_DIR OUT_DIR [--model NAME] [--flavor F]
        [--dtype bf16|fp16|fp32] [--max-shard-size 5GB] [--max-seq-len N]
        [--tokenizer PATH|none] [--overwrite] [--quiet]
    titanlab convert from-hf HF_DIR DCP_DIR [--flavor F] [--dtype auto|bf16|...]
        [--no-mtp] [--overwrite] [--quiet]
    titanlab convert to-peft DCP_DIR OUT_DIR [--overwrite]
    titanlab convert to-gguf DCP_DIR OUT.gguf [--dtype f16|bf16|q8_0|f32]
        [--model NAME] [--flavor F] [--max-seq-len N] [--tokenizer PATH] [--overwrite] [--quiet]

Any family of the model registry (Llama 3 as `LlamaForCausalLM`, Qwen3 as `Qwen3ForCausalLM`).
`to-hf` reads the model weights of a titanlab DCP checkpoint (`step-N` of any parallel layout, or
`export-step-N`; the optimizer is ignored) and writes a folder that `transformers`'
`from_pretrained` and vLLM load. The model args come from the folder's `model_args.json`
(titanlab writes it with every checkpoint); `--model` / `--flavor` name them for an older folder
(the vocab size comes from the embedding). `from-hf` derives the args from config.json (any
shape of the architecture) and writes a model-only DCP folder with them, to start training from
with `--checkpoint.initial_load_path` and `--model.flavor hf`. `to-gguf` writes one GGUF file for
llama.cpp (Llama 3 and Qwen3; `titanlab.checkpoint.gguf_export`) with the tokenizer embedded; it
needs the `gguf` package (`pip install 'titanlab[gguf]'`). For a LoRA run, `to-hf --merge-lora`
writes the merged model from the final `export-step-N` and `to-peft` writes the adapters as a
PEFT folder (`titanlab.checkpoint.peft_export`). A bad input
ends with one line `<prog>: error: ...` and exit status 2. The same command runs as
`python -m tools.convert_checkpoint` or `python tools/convert_checkpoint.py` in a checkout (prog
`convert_checkpoint`, the default here) and as `titanlab convert` (prog `titanlab`).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from titanlab.config.cli_parser import OneLineParser
from titanlab.checkpoint.convert import DTYPES, dcp_to_hf, hf_to_dcp, parse_size
from titanlab.checkpoint.gguf_export import GGUF_DTYPES, dcp_to_gguf
from titanlab.checkpoint.peft_export import dcp_to_peft
from titanlab.models.registry import DEFAULT_FAMILY, FAMILIES, get_family

PROG = "convert_checkpoint"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The parser of the four subcommands; `prog` names the program in usage and error lines."""
    parser = OneLineParser(prog=prog, description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    flavors = "; ".join(f"{n}: {', '.join(get_family(n).flavors)}" for n in FAMILIES)

    to_hf = sub.add_parser("to-hf", help="titanlab DCP checkpoint -> Hugging Face folder")
    to_hf.add_argument("dcp_dir", help="DCP checkpoint folder (step-N or export-step-N)")
    to_hf.add_argument("out_dir", help="Hugging Face folder to create")
    to_hf.add_argument(
        "--merge-lora",
        action="store_true",
        help="a LoRA run's export: write each adapted weight merged (W + alpha/r · B A)",
    )
    to_peft = sub.add_parser("to-peft", help="a LoRA run's adapters -> PEFT adapter folder")
    to_peft.add_argument("dcp_dir", help="DCP checkpoint folder of a LoRA run")
    to_peft.add_argument("out_dir", help="adapter folder to create (for peft.PeftModel)")
    to_gguf = sub.add_parser("to-gguf", help="titanlab DCP checkpoint -> GGUF file (llama.cpp)")
    to_gguf.add_argument("dcp_dir", help="DCP checkpoint folder (step-N or export-step-N)")
    to_gguf.add_argument("out_path", help="the .gguf file to create")
    to_gguf.add_argument(
        "--dtype",
        choices=list(GGUF_DTYPES),
        default="f16",
        help="type of the matrices (default: f16; q8_0: llama.cpp's 8-bit blocks; norms stay f32)",
    )
    to_hf.add_argument(
        "--dtype",
        choices=["bf16", "fp16", "fp32"],
        default="bf16",
        help="dtype of the written weights (default: bf16)",
    )
    for p in (to_hf, to_gguf):
        p.add_argument(
            "--model",
            default=None,
            choices=list(FAMILIES),
            help="model family (default: the one in model_args.json, else " + DEFAULT_FAMILY + ")",
        )
        p.add_argument(
            "--flavor",
            default=None,
            help=f"flavor the checkpoint was trained as ({flavors}; default: the args in the "
            "folder's model_args.json, else debugmodel)",
        )
        p.add_argument(
            "--max-seq-len",
            type=int,
            default=None,
            help="context length written (config.json's max_position_embeddings, GGUF's "
            "context_length; default: the model's own, recorded in the folder's "
            "model_args.json: the flavor's or the imported config.json's)",
        )
        p.add_argument(
            "--tokenizer",
            default=None,
            help="tokenizer.model or tokenizer.json (or its folder) to write the tokenizer from; "
            "'none' for none (to-hf only; default: the bundled tokenizer when the vocab size is "
            "its own)",
        )
    to_hf.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest safetensors shard, e.g. 5GB, 500MB, 2GiB (default: 5GB)",
    )

    from_hf = sub.add_parser("from-hf", help="Hugging Face folder -> titanlab DCP checkpoint")
    from_hf.add_argument("hf_dir", help="folder with config.json and .safetensors weights")
    from_hf.add_argument("dcp_dir", help="DCP folder to create")
    from_hf.add_argument(
        "--flavor",
        default=None,
        help=f"flavor the config must match ({flavors}; default: any shape, args from config.json)",
    )
    from_hf.add_argument(
        "--dtype",
        choices=["auto", "bf16", "fp16", "fp32"],
        default="auto",
        help="dtype to store (default: auto, as in the Hugging Face files)",
    )
    from_hf.add_argument(
        "--no-mtp",
        action="store_true",
        help="import without the multi-token prediction depths config.json declares "
        "(DeepSeek-V3's num_nextn_predict_layers: layers num_hidden_layers..), skipping their "
        "tensors, as transformers' DeepseekV3ForCausalLM does; a folder with none of them "
        "imports so without this flag",
    )
    for p in (to_hf, from_hf, to_gguf, to_peft):
        p.add_argument("--overwrite", action="store_true", help="replace a non-empty output")
        p.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def run(argv: list[str] | None = None, prog: str = PROG) -> str:
    """Parse `argv` and convert. Returns the summary line. Raises ValueError/OSError on bad input,
    SystemExit(2) after a one-line usage error."""
    args = build_parser(prog).parse_args(argv)
    start = time.perf_counter()
    if args.command == "to-hf":
        tokenizer = "" if args.tokenizer == "none" else args.tokenizer
        model = dcp_to_hf(
            args.dcp_dir,
            args.out_dir,
            model_name=args.model,
            flavor=args.flavor,
            dtype=DTYPES[args.dtype],
            max_shard_bytes=parse_size(args.max_shard_size),
            max_position_embeddings=args.max_seq_len,
            tokenizer_path=tokenizer,
            overwrite=args.overwrite,
            progress=not args.quiet,
            merge_lora=args.merge_lora,
        )
        dest = args.out_dir
    elif args.command == "to-peft":
        count = dcp_to_peft(args.dcp_dir, args.out_dir, overwrite=args.overwrite)
        return f"{prog}: to-peft: wrote {count} LoRA adapters to {args.out_dir}"
    elif args.command == "to-gguf":
        model = dcp_to_gguf(
            args.dcp_dir,
            args.out_path,
            dtype=args.dtype,
            model_name=args.model,
            flavor=args.flavor,
            tokenizer_path=args.tokenizer,
            max_position_embeddings=args.max_seq_len,
            overwrite=args.overwrite,
            progress=not args.quiet,
        )
        dest = args.out_path
    else:
        dtype = None if args.dtype == "auto" else DTYPES[args.dtype]
        model = hf_to_dcp(
            args.hf_dir,
            args.dcp_dir,
            flavor=args.flavor,
            dtype=dtype,
            overwrite=args.overwrite,
            progress=not args.quiet,
            mtp=not args.no_mtp,
        )
        dest = args.dcp_dir
    return (
        f"{prog}: {args.command}: wrote {dest} (dim {model.dim}, {model.n_layers} layers, "
        f"vocab {model.vocab_size}) in {time.perf_counter() - start:.1f}s"
    )


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """Run the tool; a bad input prints one `<prog>: error: ...` line (`convert_checkpoint`, or
    `titanlab` for `titanlab convert`), exit status 2."""
    name = prog.split()[0]  # as OneLineParser names it
    logging.basicConfig(level=logging.WARNING, format=f"{name}: %(message)s")
    try:
        print(run(argv, prog))
        return 0
    except (ValueError, OSError, ImportError) as e:
        message = " ".join(str(e).split())
        print(f"{name}: error: {message}", file=sys.stderr)
        return 2
    except Exception as e:  # a corrupt file deep inside torch / safetensors
        if type(e).__name__ != "SafetensorError":
            raise
        print(
            f"{name}: error: unreadable safetensors file: {' '.join(str(e).split())}",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
