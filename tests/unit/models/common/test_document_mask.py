"""Document masking: a packed window's loss equals the token-weighted mean of running each
document alone (fp32, 1e-5), with and without restarted positions; the mask and positions are
what they say; flex attention's block mask gives the dense mask's output."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from titanlab.data.labels import IGNORE_INDEX
from titanlab.data.segments import cross_document_labels_ignored, document_ids, document_positions
from titanlab.models.common.document_mask import block_causal_mask
from titanlab.models.llama3 import llama3_flavors
from titanlab.models.registry import build_model, get_family, get_flavor

EOS = 1
LLAMA = dataclasses.replace(
    llama3_flavors["debugmodel"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50,
    max_seq_len=64,
)  # fmt: skip
QWEN3 = dataclasses.replace(
    get_flavor(get_family("qwen3"), "debugmodel"), dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
    head_dim=16, hidden_dim=96, vocab_size=50, max_seq_len=64,
)  # fmt: skip


def model_of(args):
    torch.manual_seed(0)
    m = build_model(args)
    m.init_weights()
    return m.eval()


def three_documents(seed: int = 0) -> list[list[int]]:
    """Three documents, each ending in EOS; the last one cut by the window (no EOS)."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for n in (7, 12, 9):
        docs.append(torch.randint(2, 50, (n,), generator=g).tolist())
    docs[0].append(EOS)
    docs[1].append(EOS)
    return docs


def test_ids_positions_and_mask():
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, 8, 9]])
    seg = document_ids(tokens, EOS)
    assert seg.tolist() == [[0, 0, 0, 1, 1, 2, 2]]
    assert document_positions(seg).tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    mask = block_causal_mask(seg)[0, 0]
    assert mask.shape == (7, 7) and mask[3, 3] and mask[4, 3] and not mask[3, 2]
    assert not mask[2, 3] and mask[6, 5] and not mask[6, 4]


@pytest.mark.parametrize("args", [LLAMA, QWEN3], ids=["llama3", "qwen3"])
@pytest.mark.parametrize("reset", [False, True], ids=["positions-continue", "positions-reset"])
def test_packed_loss_equals_documents_run_alone(args, reset):
    model = model_of(args)
    docs = three_documents()
    window = torch.tensor([[t for d in docs for t in d]])
    inputs, labels = window[:, :-1], window[:, 1:]
    labels = cross_document_labels_ignored(inputs, labels, EOS, IGNORE_INDEX)
    seg = document_ids(inputs, EOS)
    with torch.no_grad():
        logits = model(inputs, segments=seg, positions=document_positions(seg) if reset else None)
        packed = F.cross_entropy(logits[0], labels[0], ignore_index=IGNORE_INDEX)
        total, count, offset = 0.0, 0, 0
        for doc in docs:
            alone = torch.tensor([doc])
            if reset:  # the document at positions 0.. as if it started its own window
                out = model(alone[:, :-1])
            else:  # the document at the positions it has in the window
                pos = torch.arange(offset, offset + len(doc) - 1)[None]
                out = model(alone[:, :-1], segments=torch.zeros_like(pos), positions=pos)
            total += F.cross_entropy(out[0], alone[0, 1:], reduction="sum").item()
            count += len(doc) - 1
            offset += len(doc)
    assert labels.ne(IGNORE_INDEX).sum().item() == count
    assert abs(packed.item() - total / count) < 1e-5


def test_without_masking_the_documents_see_each_other():
    """The check above can fail: plain causal attention over the window gives another loss."""
    model = model_of(LLAMA)
    window = torch.tensor([[t for d in three_documents() for t in d]])
    inputs = window[:, :-1]
    with torch.no_grad():
        masked = model(inputs, segments=document_ids(inputs, EOS))
        plain = model(inputs)
    first = len(three_documents()[0])
    torch.testing.assert_close(masked[:, :first], plain[:, :first])  # the first doc: same
    assert (masked[:, first:] - plain[:, first:]).abs().max() > 1e-3


def test_the_cuda_paths_block_mask_equals_the_dense_mask():
    """On the CUDA code path `attention_masks` gives each window a FlexAttention BlockMask
    whose element rule is the dense SDPA mask's, at a length that is not a multiple of the
    tile, and the attention's output through it (forward, compiled; FlexAttention has no CPU
    backward) equals SDPA's with the dense mask, at a multiple of the CPU kernel's 32-token
    block: torch 2.13's CPU kernel returns wrong rows when the sequence ends inside a block on
    AVX2 machines (24 tokens: |diff| 2.0, NaN in 6 of 48 rows on an AMD EPYC; exact on AVX-512
    Xeons), the defect of pytorch/pytorch#159247. On the CPU path the mask is the dense one."""
    from torch.nn.attention.flex_attention import BlockMask, create_mask

    from titanlab.config.device_path import Target, code_path_of
    from titanlab.models.common.document_mask import attention_masks

    stream = [t for d in three_documents() for t in d] * 2  # 6 documents over 60 tokens
    cpu = torch.device("cpu")
    for seq in (24, 32):
        seg = document_ids(torch.tensor([stream[:seq], stream[5 : 5 + seq]]), EOS)
        dense = attention_masks(seg, None, [None], False, seq, cpu)
        assert torch.equal(dense[None], block_causal_mask(seg))
        with code_path_of(Target("cuda", (9, 0))):
            block = attention_masks(seg, None, [None], False, seq, cpu)[None]
        assert isinstance(block, BlockMask)
        elements = create_mask(block.mask_mod, 2, 1, seq, seq, device="cpu")
        assert torch.equal(elements, block_causal_mask(seg)), seq
    model = model_of(LLAMA)
    attn = model.layers["0"].attention
    x = torch.randn(2, 32, LLAMA.dim)
    cos, sin = model.rope_cos, model.rope_sin
    with torch.no_grad():
        dense = attn(x, cos, sin, mask=block_causal_mask(seg))
        flex = attn(x, cos, sin, mask=block)
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=0)


def test_the_kernel_is_chosen_by_the_code_path():
    """CPU: no mask without documents (causal SDPA, or the local path); CUDA: a BlockMask per
    window for local attention even without documents, none for plain causal attention."""
    from torch.nn.attention.flex_attention import BlockMask

    from titanlab.config.device_path import Target, code_path_of
    from titanlab.models.common.document_mask import attention_masks
    from titanlab.models.common.flex_masks import computed_fraction

    cpu = torch.device("cpu")
    assert attention_masks(None, None, [None, 128], True, 1024, cpu) is None
    with code_path_of(Target("cuda", (9, 0))):
        assert attention_masks(None, None, [None], False, 1024, cpu) is None
        masks = attention_masks(None, None, [None, 128, None], True, 1024, cpu)
    assert set(masks) == {None, 128} and all(isinstance(m, BlockMask) for m in masks.values())
    assert computed_fraction(masks[None]) == 36 / 64  # causal: n(n + 1)/2 of n² tiles, n = 8
    assert computed_fraction(masks[128]) == 15 / 64  # the diagonal and the tile before it
