"""Fuzzing of user input: random configs and command lines, random corruptions of a prepared
dataset and of a checkpoint folder, and random inputs to tools/prepare_data.py and
tools/convert_checkpoint.py.

Each input must either pass or fail with exactly one error line and exit status 2, never with
a traceback, and must leave no partial write behind. Hypothesis runs derandomized (a fixed
seed) with a bounded number of examples, so CI tries the same inputs every time; each test
asserts how many it tried.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import string
import sys

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from titanlab import preflight  # noqa: E402
from titanlab.config.docs import sections  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from tools import convert_checkpoint, prepare_data  # noqa: E402


def fuzz(examples: int) -> settings:
    """Fixed seed, no example database, no deadline: the same inputs on every run."""
    return settings(
        derandomize=True,
        deadline=None,
        database=None,
        max_examples=examples,
        suppress_health_check=list(HealthCheck),
    )


KEYS = sorted(f"{name}.{f}" for name, cls in sections() for f in cls.__dataclass_fields__)
SMALL = [
    "--model.flavor",
    "debugmodel_deep",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
]
TRIED: dict[str, int] = {}


def _count(name: str) -> None:
    TRIED[name] = TRIED.get(name, 0) + 1


def tries_at_least(name: str, minimum: int):
    """The fuzzer test below (Hypothesis-wrapped) must have run `minimum` examples counted as
    `name` by the time it returns (a fuzzer whose strategy filters everything out fails)."""

    def wrap(test):
        @functools.wraps(test)
        def checked(*args, **kwargs):
            before = TRIED.get(name, 0)
            test(*args, **kwargs)
            tried = TRIED.get(name, 0) - before
            print(f"fuzz inputs tried ({name}): {tried}")
            assert tried >= minimum, (name, tried)

        return checked

    return wrap


def assert_one_error_line(code: int, err: str, prefix: str) -> None:
    """Exit 0 with no error, or exit 2 with exactly one line `prefix ...`, the last one (a
    progress bar may come before it), and no traceback."""
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert "Traceback" not in err, err
    if code == 0:
        assert not any(ln.startswith(prefix) for ln in lines), err
        return
    assert code == 2, (code, err)
    assert sum(ln.startswith(prefix) for ln in lines) == 1 and lines[-1].startswith(prefix), err


def files_under(path) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs}


values = st.one_of(
    st.integers(-3, 20).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(
        [
            "true",
            "false",
            "-1",
            "0",
            "1F1B",
            "DualPipeV",
            "nan",
            "inf",
            "",
            "1e309",
            "bfloat16",
            "none",
            "op",
            "full",
            "[1,2]",
            "a,b",
            "--x",
            "0x10",
        ]
    ),
    st.text(string.printable, max_size=12),
)
option = st.tuples(
    st.one_of(
        st.sampled_from(KEYS), st.text(string.ascii_lowercase + "._", min_size=1, max_size=20)
    ),
    values,
)


@tries_at_least("config", 200)
@fuzz(250)
@given(
    nproc=st.integers(-1, 9),
    options=st.lists(option, max_size=6),
    raw=st.lists(st.text(string.printable, max_size=10), max_size=2),
)
def test_random_configs_pass_or_fail_with_one_line(
    nproc, options, raw, tmp_path_factory, capsys, monkeypatch
):
    _count("config")
    work = tmp_path_factory.mktemp("cfg")
    monkeypatch.chdir(work)
    argv = ["--nproc", str(nproc), "--job.dump_folder", str(work / "dump"), *SMALL]
    for key, value in options:
        argv += [f"--{key}", value]
    argv += raw
    code = preflight.main(argv)
    assert_one_error_line(code, capsys.readouterr().err, "titanlab: error:")
    assert not os.listdir(work)  # the pre-flight check writes nothing


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from titanlab.data.default_corpus import default_corpus_files
    from titanlab.data.prepare import prepare_data as prepare
    from titanlab.data.tokenizer import default_tokenizer_path

    out = str(tmp_path_factory.mktemp("data") / "ds")
    files = [f for f in default_corpus_files() if os.sep + "json" + os.sep in f][:6]
    prepare(files, out, default_tokenizer_path(), workers=1, shard_size_mb=0.02, progress=False)
    return out


json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-10, 10**6),
        st.floats(allow_nan=False),
        st.text(max_size=8),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
corruption = st.one_of(
    st.tuples(st.just("truncate"), st.integers(0, 3), st.floats(0, 1)),
    st.tuples(st.just("append"), st.integers(0, 3), st.binary(min_size=1, max_size=5)),
    st.tuples(st.just("delete"), st.integers(0, 4), st.none()),
    st.tuples(st.just("metadata_bytes"), st.none(), st.binary(max_size=40)),
    st.tuples(
        st.just("metadata_field"),
        st.sampled_from(
            [
                "dtype",
                "shards",
                "vocab_size",
                "tokenizer_fingerprint",
                "total_tokens",
                "0.file",
                "0.tokens",
                "1.tokens",
            ]
        ),
        json_values,
    ),
)


def corrupt_dataset(path: str, kind: str, which, arg) -> None:
    shards = sorted(f for f in os.listdir(path) if f.endswith(".bin"))
    meta_path = os.path.join(path, "metadata.json")
    if kind in ("truncate", "append"):
        if not shards:
            return
        shard = os.path.join(path, shards[which % len(shards)])
        if kind == "truncate":
            with open(shard, "r+b") as f:
                f.truncate(int(os.path.getsize(shard) * arg))
        else:
            with open(shard, "ab") as f:
                f.write(arg)
    elif kind == "delete":
        names = sorted(os.listdir(path))
        if names:
            os.remove(os.path.join(path, names[which % len(names)]))
    elif kind == "metadata_bytes":
        with open(meta_path, "wb") as f:
            f.write(arg)
    else:
        try:
            meta = json.load(open(meta_path, encoding="utf-8"))
        except (OSError, ValueError):
            return  # an earlier corruption already broke it
        if not isinstance(meta, dict):
            return
        if "." in which:
            index, field = which.split(".")
            shards = meta.get("shards")
            if (
                isinstance(shards, list)
                and int(index) < len(shards)
                and isinstance(shards[int(index)], dict)
            ):
                shards[int(index)][field] = arg
        else:
            meta[which] = arg
        with open(meta_path, "w") as f:
            json.dump(meta, f)


@tries_at_least("dataset", 100)
@fuzz(150)
@given(corruptions=st.lists(corruption, min_size=1, max_size=2))
def test_corrupt_datasets_fail_with_one_line(corruptions, dataset, tmp_path_factory, capsys):
    _count("dataset")
    work = tmp_path_factory.mktemp("corrupt")
    data = str(work / "ds")
    shutil.copytree(dataset, data)
    for kind, which, arg in corruptions:
        corrupt_dataset(data, kind, which, arg)
    before = files_under(work)
    code = preflight.main(
        [
            "--nproc",
            "1",
            "--data.dataset_path",
            data,
            *SMALL,
            "--job.dump_folder",
            str(work / "dump"),
        ]
    )
    assert_one_error_line(code, capsys.readouterr().err, "titanlab: error:")
    assert files_under(work) == before


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A complete DCP checkpoint `<root>/checkpoint/step-3` of the debugmodel_deep weights."""
    import dataclasses

    import torch.distributed.checkpoint as dcp

    from titanlab.models.llama3 import Transformer, llama3_flavors

    root = tmp_path_factory.mktemp("ckpt")
    model = Transformer(
        dataclasses.replace(llama3_flavors["debugmodel_deep"], vocab_size=4352, max_seq_len=64)
    )
    model.init_weights()
    path = str(root / "checkpoint" / "step-3")
    dcp.save({"model": model.state_dict(), "train_state": {"step": 3}}, checkpoint_id=path)
    return str(root)


@tries_at_least("checkpoint", 50)
@fuzz(80)
@given(
    kind=st.sampled_from(["truncate", "delete", "metadata_bytes", "metadata_truncate", "extra"]),
    which=st.integers(0, 5),
    fraction=st.floats(0, 1),
    blob=st.binary(max_size=64),
    step=st.integers(-1, 4),
)
def test_corrupt_checkpoints_fail_with_one_line(
    kind, which, fraction, blob, step, checkpoint, tmp_path_factory, capsys
):
    _count("checkpoint")
    work = tmp_path_factory.mktemp("ckpt_fuzz")
    dump = str(work / "run")
    shutil.copytree(checkpoint, dump)
    step_dir = os.path.join(dump, "checkpoint", "step-3")
    names = sorted(os.listdir(step_dir))
    victim = os.path.join(step_dir, names[which % len(names)])
    if kind == "truncate":
        with open(victim, "r+b") as f:
            f.truncate(int(os.path.getsize(victim) * fraction))
    elif kind == "delete":
        os.remove(victim)
    elif kind == "metadata_bytes":
        with open(os.path.join(step_dir, ".metadata"), "wb") as f:
            f.write(blob)
    elif kind == "metadata_truncate":
        meta = os.path.join(step_dir, ".metadata")
        with open(meta, "r+b") as f:
            f.truncate(int(os.path.getsize(meta) * fraction))
    else:
        os.makedirs(os.path.join(dump, "checkpoint", f"step-{which}"), exist_ok=True)
    before = files_under(work)
    code = preflight.main(
        [
            "--nproc",
            "1",
            *SMALL,
            "--job.dump_folder",
            dump,
            "--checkpoint.enable",
            "true",
            "--checkpoint.load_step",
            str(step),
            "--checkpoint.initial_load_path",
            step_dir,
        ]
    )
    assert_one_error_line(code, capsys.readouterr().err, "titanlab: error:")
    assert files_under(work) == before


tool_args = st.lists(
    st.one_of(
        st.sampled_from(
            [
                "--workers",
                "--shard-size-mb",
                "--text-key",
                "--tokenizer",
                "--overwrite",
                "--output",
                "0",
                "-1",
                "nan",
                "1e9",
                "x",
                "--flavor",
                "--dtype",
                "bf16",
                "--max-shard-size",
                "0B",
                "5GB",
                "--max-seq-len",
                "--quiet",
                "to-hf",
                "from-hf",
                "none",
                "--help-me",
            ]
        ),
        st.text(string.ascii_letters + string.digits + "-_.", max_size=8),
    ),
    max_size=6,
)


@tries_at_least("prepare_data", 80)
@fuzz(120)
@given(
    args=tool_args,
    content=st.one_of(st.binary(max_size=60), st.text(max_size=60).map(str.encode)),
    suffix=st.sampled_from([".txt", ".jsonl", ".jsonl.gz", ".parquet", ".py"]),
)
def test_prepare_data_inputs_fail_with_one_line(
    args, content, suffix, tmp_path_factory, capsys, monkeypatch
):
    _count("prepare_data")
    work = tmp_path_factory.mktemp("prep")
    monkeypatch.chdir(work)
    src = work / f"input{suffix}"
    src.write_bytes(content)
    out = work / "out"
    try:
        code = prepare_data.main([str(src), "--output", str(out), *args])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 2
    assert_one_error_line(code or 0, capsys.readouterr().err, "prepare_data: error:")
    if out.exists():  # whatever was written is whole: shards listed in metadata, no temp files
        assert not [f for f in files_under(out) if ".tmp" in f or f.endswith(".partial")]


@tries_at_least("convert_checkpoint", 80)
@fuzz(120)
@given(
    command=st.sampled_from(["to-hf", "from-hf", "x"]),
    args=tool_args,
    corrupt=st.sampled_from([None, "truncate", "metadata"]),
    fraction=st.floats(0, 1),
)
def test_convert_checkpoint_inputs_fail_with_one_line(
    command, args, corrupt, fraction, checkpoint, tmp_path_factory, capsys, monkeypatch
):
    _count("convert_checkpoint")
    work = tmp_path_factory.mktemp("conv")
    monkeypatch.chdir(work)
    src = str(work / "step-3")
    shutil.copytree(os.path.join(checkpoint, "checkpoint", "step-3"), src)
    if corrupt:
        name = (
            ".metadata"
            if corrupt == "metadata"
            else sorted(f for f in os.listdir(src) if f.endswith(".distcp"))[0]
        )
        with open(os.path.join(src, name), "r+b") as f:
            f.truncate(int(os.path.getsize(os.path.join(src, name)) * fraction))
    out = work / "out"
    try:
        code = convert_checkpoint.main([command, src, str(out), "--quiet", *args])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 2
    assert_one_error_line(code, capsys.readouterr().err, "convert_checkpoint: error:")
    if code != 0 and out.exists():  # a failed conversion leaves nothing that looks complete
        assert not (out / "config.json").exists() and not (out / ".metadata").exists()


# --- known bad inputs, each one line naming the value and what is valid ------------------------


@pytest.fixture(scope="module")
def generation_checkpoint(checkpoint, tmp_path_factory):
    """A copy of `checkpoint`'s step-3 that `titanlab generate` loads (its model_args.json)."""
    import dataclasses

    from titanlab.models.llama3 import llama3_flavors
    from titanlab.models.registry import get_family
    from titanlab.models.stored_args import write_model_args

    path = str(tmp_path_factory.mktemp("gen") / "step-3")
    shutil.copytree(os.path.join(checkpoint, "checkpoint", "step-3"), path)
    args = dataclasses.replace(llama3_flavors["debugmodel_deep"], vocab_size=4352, max_seq_len=64)
    write_model_args(path, get_family("llama3"), args)
    return path


CONFIG = "debug_model.toml"  # a shipped config by its name
PREFLIGHT = ["--job.config_file", CONFIG]
GPT_OSS = ["--model.name", "gpt_oss", "--model.flavor", "debugmodel"]
ULYSSES = ["--parallelism.context_parallel_mode", "ulysses"]
# (the `titanlab` command line, with {ckpt} a checkpoint `generate` loads, {folder} a folder of
# one text file (no checkpoint, no config.json) and {tmp} an empty work folder; a substring of
# the one error line, the last on stderr)
BAD_INPUTS = [
    (["ledger", CONFIG, "--top", "-3"], "argument --top: '-3' is not a positive integer (>= 1)"),
    (["ledger", CONFIG, "--top", "0"], "argument --top: '0' is not a positive integer (>= 1)"),
    (["ledger", CONFIG, "--devices", "h100"], "unknown option --devices; did you mean '--device'?"),
    (["ledger", CONFIG, "--json", "/nonexistent/dir/x.json"],
     "--json '/nonexistent/dir/x.json': the folder '/nonexistent/dir' does not exist; give a file "
     "in an existing folder"),
    (["ledger", CONFIG, "--device", "h100", "--comm.dry_run_device", "a100"],
     "--device h100 and --comm.dry_run_device a100 name different devices; give one of them"),
    (["preflight", *PREFLIGHT, "--fault_tolerance.quorum_timeout_seconds", "-5"],
     "fault_tolerance.quorum_timeout_seconds=-5.0 must be a number of seconds > 0"),
    (["preflight", *PREFLIGHT, "--fault_tolerance.timeout_seconds", "0"],
     "fault_tolerance.timeout_seconds=0.0 must be a number of seconds > 0"),
    (["preflight", *PREFLIGHT, "--fault_tolerance.semi_sync_method", "diloco"],
     "fault_tolerance.semi_sync_method=diloco needs fault_tolerance.enable=true"),
    (["preflight", *PREFLIGHT, "--fault_tolerance.lighthouse", "localhost:29510"],
     "fault_tolerance.lighthouse='localhost:29510' is not an address like http://host:port (e.g. "
     "http://localhost:29510)"),
    (["preflight", *PREFLIGHT, "--model.flavor", "hf", "--model.hf_config", "/no/such/dir"],
     "model.hf_config='/no/such/dir' does not exist; give a Hugging Face config.json or the "
     "folder holding it"),
    (["preflight", *PREFLIGHT, "--model.flavor", "hf", "--model.hf_config", "{folder}"],
     "model.hf_config='{folder}' is a folder without a config.json; give a Hugging Face "
     "config.json or the folder holding it"),
    (["preflight", *PREFLIGHT, "--model.hf_config", "/no/such/dir"],
     "model.hf_config='/no/such/dir' is read only with model.flavor=hf"),
    (["preflight", *PREFLIGHT, *GPT_OSS, "--model.sliding_window", "256"],
     "unknown config key model.sliding_window: [model] takes no architecture fields (sizes, "
     "heads, attention windows, experts); model.flavor sets them"),
    (["preflight", *PREFLIGHT, *ULYSSES, "--parallelism.context_parallel_load_balancer", "work"],
     "parallelism.context_parallel_load_balancer=work does not apply to "
     "context_parallel_mode=ulysses (each rank attends the whole sequence for its heads: nothing "
     "to balance); valid with ulysses: none or auto"),
    (["preflight", *PREFLIGHT, *ULYSSES, "--parallelism.context_parallel_load_balancer", "head_tail"],
     "context_parallel_load_balancer=head_tail does not apply to context_parallel_mode=ulysses"),
    (["convert", "to-hf", "{folder}", "{tmp}/out"],
     "'{folder}' is not a DCP checkpoint: it holds 1 file(s), none of them DCP's (a checkpoint "
     "folder has a .metadata and *.distcp data files"),
    (["generate", "{ckpt}", "--prompt", "hi", "--max-new-tokens", "-5"],
     "argument --max-new-tokens: '-5' is not a positive integer (>= 1)"),
    (["generate", "{ckpt}", "--prompt", "hi", "--max-new-tokens", "8", "--mtp-draft"],
     "needs a model with MTP depths; Transformer (mtp_layers=0) has none: decode without the draft"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "expected"),
    BAD_INPUTS,
    ids=[" ".join(a).replace(" --job.config_file", "") for a, _ in BAD_INPUTS],
)
def test_known_bad_inputs_end_with_one_line_naming_the_value(
    argv, expected, generation_checkpoint, tmp_path, capsys, monkeypatch
):
    """Each is refused before anything runs or prints: exit 2, one `titanlab: error:` line, the
    last one, naming the value and what is valid; no traceback and nothing on stdout."""
    from titanlab import cli

    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "not_a_checkpoint"
    folder.mkdir()
    (folder / "notes.txt").write_text("not a checkpoint\n")
    names = {"ckpt": generation_checkpoint, "folder": str(folder), "tmp": str(tmp_path)}
    try:
        code = cli.main([a.format(**names) for a in argv])
    except SystemExit as e:  # argparse's one-line usage errors
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert lines[-1].startswith("titanlab: error: "), lines[-3:]
    assert sum(ln.startswith("titanlab: error:") for ln in lines) == 1, lines
    assert expected.format(**names) in lines[-1], lines[-1]
    assert out == "", out  # nothing printed before the refusal (the prompt included)


def test_a_folder_that_never_was_a_checkpoint_is_told_from_a_cut_off_one(checkpoint, tmp_path):
    """`titanlab convert to-hf` (`DcpModelReader`): a folder with no DCP file at all, an empty one
    and one holding checkpoints get a line of their own; a write cut off before its .metadata
    keeps "the write did not finish"."""
    from titanlab.checkpoint.streaming import ConversionError, DcpModelReader

    cut = tmp_path / "step-3"
    shutil.copytree(os.path.join(checkpoint, "checkpoint", "step-3"), cut)
    os.remove(cut / ".metadata")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = {
        str(cut): f"DCP checkpoint {str(cut)!r} cannot be read: no .metadata (the write did not "
        "finish)",
        str(empty): f"{str(empty)!r} is not a DCP checkpoint: it is empty (a checkpoint folder "
        "has a .metadata and *.distcp data files, e.g. <dump_folder>/checkpoint/step-N)",
        checkpoint: f"{checkpoint!r} is not a DCP checkpoint but holds some (checkpoint/step-3): "
        "give one of those folders",
    }
    for path, line in cases.items():
        with pytest.raises(ConversionError) as e:
            DcpModelReader(path)
        assert str(e.value) == line
