"""DeepSeek-V3 (multi-head latent attention, dense first block, group-limited routing with the
auxiliary-loss-free bias, a shared expert) under data, tensor, pipeline and expert parallelism
equals one process, from one seed checkpoint, fp32, 3 steps, within 1e-5, and its expert biases
after 3 steps are equal bitwise; the debug flavor's multi-token prediction depth trains under
FSDP × EP, TP, PP and TP × PP to the 1-process losses (main and MTP). The debug config trains on 2 processes, resumes bitwise, and
its export loads in transformers with equal logits.

The cases are generated from the layouts of 2 and 4 ranks the trainer's validator accepts for
the model: CI runs a pairwise cover of those with expert parallel (every pair of FSDP, DDP,
HSDP, TP, EP 2 / 4, experts FSDP-sharded and PP 1F1B that meets in one, meets once:
`titanlab.planning.layout_cover.pairwise_subset`). `make test-parity-full` (TITANLAB_PARITY_FULL=1) runs every accepted layout, every
pipeline schedule included.
"""

import dataclasses
import json
import os

import pytest
import torch

from conftest import CONSTANT_LR, REPO, checkpoint_every, read_metrics, run_config
from titanlab.checkpoint.convert import DcpModelReader
from titanlab.data.tokenizer import Tokenizer, default_tokenizer_path
from titanlab.models.registry import build_model
from titanlab.models.stored_args import read_model_args
from titanlab.planning.layout_cover import pairwise_subset
from titanlab.planning.layouts import SCHEDULES
from tests.coverage_spec import cover_cases
from tools import parity_matrix

FULL = os.environ.get("TITANLAB_PARITY_FULL") == "1"
OPTIONS = ["--model.name", "deepseek_v3", "--model.moe_bias_update_speed", "0.01"]


def _cases() -> list[parity_matrix.Layout]:
    pool = parity_matrix.valid_layouts(
        (2, 4), OPTIONS, with_ep=True, schedules=SCHEDULES if FULL else ("1F1B",)
    )
    if FULL:
        return pool
    expert_parallel = [lay for lay in pool if lay.ep > 1 and lay.grad_accum == 1]
    return pairwise_subset(expert_parallel, must=(frozenset({"pp:1F1B"}),))


CASES = _cases()


@pytest.fixture(scope="module")
def reference(tiny_dataset, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("deepseek_v3"))
    return (*parity_matrix.prepare_reference(root, tiny_dataset, extra=OPTIONS), root)


def _biases(dump: str) -> dict[str, torch.Tensor]:
    reader = DcpModelReader(os.path.join(dump, "checkpoint", f"step-{parity_matrix.LAYOUT_STEPS}"))
    return {k: reader.load(k) for k in reader.tensors if k.endswith("expert_bias")}


@pytest.mark.parametrize(
    "layout", cover_cases("deepseek_v3", CASES, ids=[lay.name for lay in CASES])
)
def test_deepseek_v3_layout_matches_single_process(layout, reference):
    dataset, seed, losses, root = reference
    outcome = parity_matrix.run_layout(layout, dataset, seed, losses, root, extra=OPTIONS)
    assert outcome.error is None, outcome.report()
    print(f"deepseek_v3 {layout.name}: worst |Δloss| {outcome.max_abs_diff:.3g}")
    assert outcome.max_abs_diff <= parity_matrix.TOLERANCE, (layout.name, outcome.max_abs_diff)
    assert losses[parity_matrix.STEPS] < losses[1]
    want = _biases(outcome.reference_dir)
    got = _biases(os.path.join(root, "runs", layout.name))
    assert want and want.keys() == got.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), "expert biases differ"
    assert any(v.abs().sum() > 0 for v in want.values())  # the bias did move


# The debug flavor's MTP depth, with DeepSeek-V3's sequence-wise balance loss (weight far above
# the paper's 1e-4, so a wrong gradient shows in 3 steps; refused under TP) or with the bias
# balancing alone (any layout).
MTP_FLAVOR = [*OPTIONS, "--model.flavor", "debugmodel"]
MTP_OPTIONS = {
    "seq_aux": [*MTP_FLAVOR, "--model.moe_load_balance_coeff", "0.1"],
    "bias": MTP_FLAVOR,
}
MTP_NEEDS = [
    ("seq_aux", {"fsdp", "ep", "grad_accum"}),  # CI: FSDP × EP with accumulation
    ("bias", {"tp", "pp:1F1B"}),  # CI: TP × PP (each of them, on one layout)
    ("seq_aux", {"ddp"}),  # CI: replicated (DDP)
] + (
    [
        ("seq_aux", {"fsdp", "ep"}),
        ("bias", {"tp"}),
        ("bias", {"pp:1F1B"}),
        ("seq_aux", {"ep4"}),
        ("bias", {"tp", "ep"}),
        ("bias", {"pp:1F1B", "ep"}),
    ]
    + [("bias", {f"pp:{s}"}) for s in SCHEDULES if s != "1F1B"]
    if FULL
    else []
)
"""The MTP cases: in CI, FSDP × EP with accumulation (the sequence-wise balance loss), TP × PP
(the depth on the last stage, sequence-sharded; TP 2 × EP 2 × PP 2 also resumes bitwise below)
and DDP; make test-full adds each of them alone, EP 4, TP × EP, PP × EP and every schedule."""
MTP_TAG_DIMS = {"fsdp": ("dp_shard",), "ddp": ("dp_replicate",), "tp": ("tp",), "pp": ("pp",),
                "ep": ("dp_shard", "ep"), "ep4": ("dp_shard", "ep")}  # fmt: skip
"""The dimensions of a case's `need` tags (EP borrows the FSDP ranks)."""


def _mtp_cells(need: set[str]) -> list[str]:
    """The cover cells (tests/coverage_spec.py) of an MTP case."""
    dims = {d for tag in need if tag != "grad_accum" for d in MTP_TAG_DIMS[tag.split(":")[0]]}
    schedules = [f"schedule:{tag[3:]}" for tag in need if tag.startswith("pp:")]
    return sorted(f"{f}×{d}" for f in ("mtp", "deepseek_v3") for d in dims) + schedules


def _mtp_case(kind: str, need: set[str]) -> parity_matrix.Layout:
    schedules = SCHEDULES if FULL else ("1F1B",)
    pool = parity_matrix.valid_layouts((2, 4), MTP_OPTIONS[kind], with_ep=True, schedules=schedules)
    fits = [
        lay for lay in pool if need <= lay.tags and ("grad_accum" in need) == (lay.grad_accum > 1)
    ]
    assert fits, f"no valid layout of 2 or 4 ranks has {sorted(need)}"
    return min(fits, key=lambda lay: (lay.world_size, len(lay.features), lay.name))


@pytest.fixture(scope="module")
def mtp_references(tiny_dataset, tmp_path_factory):
    """(dataset, seed checkpoint, 1-process losses, root) per MTP option set, made once."""
    made: dict = {}

    def get(kind: str):
        if kind not in made:
            root = str(tmp_path_factory.mktemp(f"deepseek_v3_mtp_{kind}"))
            ref = parity_matrix.prepare_reference(root, tiny_dataset, extra=MTP_OPTIONS[kind])
            made[kind] = (*ref, root)
        return made[kind]

    return get


def _mtp_losses(dump: str) -> dict[int, float]:
    with open(os.path.join(dump, "metrics.jsonl"), encoding="utf-8") as f:
        return {r["step"]: r["mtp_loss"] for r in map(json.loads, f)}


@pytest.mark.parametrize(
    "kind,need",
    [pytest.param(k, n, marks=pytest.mark.cover(*_mtp_cells(n))) for k, n in MTP_NEEDS],
    ids=[f"{k}-" + "-".join(sorted(n)) for k, n in MTP_NEEDS],
)
def test_multi_token_prediction_trains_equal_to_one_process(kind, need, mtp_references):
    """The debug flavor's MTP depth trains to the 1-process losses, main and MTP: its block's
    experts split by EP, the depth an FSDP unit of its own, the output head used twice per
    forward; under TP sequence-sharded (its norms and eh_proj replicated, the block by the
    block plan, the head's loss vocab-parallel); under PP on the last stage, with the rolled
    tokens' embeddings carried from the first stage across every boundary. With the
    sequence-wise balance loss (each sequence's statistics, a mean over the global batch's
    sequences, gradient accumulation included) where the layout allows it."""
    dataset, seed, losses, root = mtp_references(kind)
    layout = _mtp_case(kind, need)
    outcome = parity_matrix.run_layout(layout, dataset, seed, losses, root, extra=MTP_OPTIONS[kind])
    assert outcome.error is None, outcome.report()
    want = _mtp_losses(outcome.reference_dir)
    got = _mtp_losses(os.path.join(root, "runs", layout.name))
    assert sorted(got) == list(range(1, parity_matrix.LAYOUT_STEPS + 1))
    mtp_diff = max(abs(got[s] - want[s]) for s in got)
    print(
        f"deepseek_v3 debugmodel (MTP, {kind}) {layout.name}: worst |Δloss| "
        f"{outcome.max_abs_diff:.3g}, worst |Δmtp_loss| {mtp_diff:.3g}"
    )
    assert outcome.max_abs_diff <= parity_matrix.TOLERANCE
    assert mtp_diff <= parity_matrix.TOLERANCE and want[parity_matrix.STEPS] < want[1]


def test_deepseek_v3_debug_config_trains_resumes_exactly_and_exports_to_transformers(
    tiny_dataset, tmp_path, capsys
):
    """train_configs/deepseek_v3_debug.toml on 2 warm ranks as run_train.sh trains it (FSDP 2 ×
    EP 2): the
    loss falls, a run resumed at step 4 logs the same 8 losses bitwise, the trainer's Hugging
    Face export loads in transformers with the trained model's logits, and generation from the
    export with its trained MTP depth drafting prints what plain decoding prints."""
    transformers = pytest.importorskip("transformers")
    common = [
        "train_configs/deepseek_v3_debug.toml",
        "--data.dataset_path", tiny_dataset,
        "--training.seq_len", "64",
        "--training.local_batch_size", "4",
        "--metrics.log_freq", "1",
        "--validation.enable", "false",
        "--debug.deterministic", "true",
        *CONSTANT_LR,
        *checkpoint_every(4, "--checkpoint.keep_latest_k", "0"),
        "--checkpoint.export_at_end", "true",
        "--checkpoint.last_save_in_hf", "true",
    ]  # fmt: skip
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for steps, dump in (("8", straight), ("4", resumed), ("8", resumed)):
        proc = run_config(*common, "--training.steps", steps, "--job.dump_folder", str(dump))
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "model: deepseek_v3 debugmodel" in proc.stdout and "ep=2" in proc.stdout
    want, got = read_metrics(str(straight)), read_metrics(str(resumed))
    assert [got[s] for s in range(1, 9)] == [want[s] for s in range(1, 9)]  # bitwise
    assert want[8] < want[1]
    with open(straight / "metrics.jsonl", encoding="utf-8") as f:
        mtp = {r["step"]: r["mtp_loss"] for r in map(json.loads, f)}  # the MTP depth trains
    assert mtp[8] < mtp[1] and "mtp_loss:" in proc.stdout

    export = straight / "checkpoint" / "export-step-8"
    stored = read_model_args(str(export))
    assert stored is not None and stored[0].name == "deepseek_v3"
    reader = DcpModelReader(str(export))
    model = build_model(dataclasses.replace(stored[2], max_seq_len=64)).eval()
    model.load_state_dict({k: reader.load(k) for k in model.state_dict()})
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(straight / "checkpoint" / "hf-step-8"), dtype=torch.float32
    ).eval()
    tokenizer = Tokenizer(default_tokenizer_path())
    with open(os.path.join(REPO, "titanlab", "models", "common", "mla.py"), encoding="utf-8") as f:
        tokens = torch.tensor(tokenizer.encode(f.read(), bos=True, eos=False)[:128]).view(2, 64)
    with torch.no_grad():
        diff = (model(tokens) - hf(tokens).logits).abs().max().item()
    print(f"deepseek_v3 debug export: max |logits - transformers| = {diff:.3g}")
    assert diff < 1e-4

    # the trained MTP depth drafts for `python -m titanlab.generate`: the same text, fewer forwards
    from titanlab.generation import cli

    texts, _ = [], capsys.readouterr()
    for extra in ([], ["--mtp-draft"]):
        argv = [str(export), "--prompt", "def main(", "--prompt", "import os", *extra]
        assert cli.main([*argv, "--max-new-tokens", "24"]) == 0
        texts.append(capsys.readouterr())
    assert texts[1].out == texts[0].out
    print(texts[1].err.strip().splitlines()[-2])  # MTP draft: N of M drafts accepted (..%)
    assert texts[1].err.strip().splitlines()[-2].startswith("MTP draft: ")


def test_multi_token_prediction_under_pp_and_tp_resumes_bitwise(train, tmp_path):
    """TP 2 × EP 2 × PP 2 with the MTP depth training (its weights and optimizer state on the
    last stage): a run stopped at step 3 and resumed logs the straight run's 6 losses and MTP
    losses bitwise. The flavor's first 2 blocks (the dense one and an MoE one, a stage each),
    as a resume does not depend on the depth."""
    common = [*MTP_FLAVOR, "--parallelism.tensor_parallel_degree", "2",
              "--parallelism.expert_parallel_degree", "2",
              "--parallelism.pipeline_parallel_degree", "2",
              "--training.local_batch_size", "4", "--metrics.log_freq", "1",
              "--debug.deterministic", "true", *CONSTANT_LR,
              *checkpoint_every(3, "--checkpoint.keep_latest_k", "0")]  # fmt: skip
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    train(4, *common, "--training.steps", "6", dump=straight).check()
    train(4, *common, "--training.steps", "3", dump=resumed).check()
    train(4, *common, "--training.steps", "6", dump=resumed).check()
    want, got = read_metrics(straight), read_metrics(resumed)
    assert [got[s] for s in range(1, 7)] == [want[s] for s in range(1, 7)]
    assert _mtp_losses(resumed) == _mtp_losses(straight)
    with open(os.path.join(resumed, "metrics.jsonl"), encoding="utf-8") as f:
        logged = [r["step"] for r in map(json.loads, f)]
    assert logged == [1, 2, 3, 4, 5, 6]  # the second run started at step 4, from the checkpoint
