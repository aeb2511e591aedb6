"""What the memory estimator counts for masked attention (`planning/cp_memory.py`): on CUDA
FlexAttention's tile tables, on the CPU the dense masks, for Llama 3 8B at 128k tokens with
documents under CP 8 (ring) and on one rank; a plain packed run (not chat data) counts no mask,
and an unreadable dataset leaves the question to the loader."""

from __future__ import annotations

from titanlab.config.manager import build_config
from titanlab.planning.cp_memory import cp_attention_bytes
from titanlab.planning.planner import model_args_of


def _config(*extra: str):
    config = build_config(["--job.config_file", "train_configs/llama_8b.toml",
                           "--training.seq_len", "131072", *extra])  # fmt: skip
    return config, model_args_of(config)


def test_flexattention_tables_against_dense_masks():
    config, args = _config("--data.document_mask", "true",
                           "--parallelism.context_parallel_degree", "8")  # fmt: skip
    s = 131072
    cuda, _ = cp_attention_bytes(config, args, 1, s, 8, 1, 2, "cuda")
    cpu, _ = cp_attention_bytes(config, args, 1, s, 8, 1, 2, "cpu")
    assert cuda == 4 * 4 * (s // 8 // 128) * (s // 128)  # 2 MiB: four int32 tile tables
    assert cpu == (s // 8) * s  # 2 GiB: the rank's dense bool rows
    one_cuda, _ = cp_attention_bytes(config, args, 1, s, 1, 1, 2, "cuda")
    one_cpu, _ = cp_attention_bytes(config, args, 1, s, 1, 1, 2, "cpu")
    assert one_cuda == 4 * 4 * (s // 128) ** 2 and one_cpu == s * s


def test_a_plain_packed_run_and_unreadable_data_count_no_mask(tmp_path):
    broken = tmp_path / "data"
    broken.mkdir()
    (broken / "metadata.json").write_text("{not json")
    config, args = _config("--data.dataset_path", str(broken))
    assert config.data.packing and not config.data.document_mask
    assert cp_attention_bytes(config, args, 1, 131072, 1, 1, 2, "cpu") == (0, 0)
