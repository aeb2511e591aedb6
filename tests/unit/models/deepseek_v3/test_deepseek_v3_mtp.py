"""DeepSeek-V3's multi-token prediction depth against transformers' `MtpModel`: a checkpoint
with the depth stored as layer L (DeepSeek's layout, with its copies of the embedding and head)
imports, the depth's logits equal transformers' within 1e-4, the MTP loss is their
cross-entropy against the labels shifted by one, and the folder round-trips bitwise."""

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "qwen3"))
from test_deepseek_v3_hf import ds_config, random_ds_model
from test_qwen3_hf import read_folder, real_tokens

from titanlab.checkpoint.convert import DcpModelReader, dcp_to_hf, hf_to_dcp
from titanlab.models.common.mtp import mtp_targets
from titanlab.models.registry import build_model

transformers = pytest.importorskip("transformers")
from transformers.modeling_layers import MtpModel  # noqa: E402

L = 2


def _mtp_files(mtp: MtpModel, intermediate: int) -> dict[str, torch.Tensor]:
    """The depth's tensors under DeepSeek's checkpoint names (`model.layers.{L}.*`), the fused
    experts split per expert as the files hold them."""
    out = {}
    for name, t in mtp.layers[0].state_dict().items():
        name = name.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        if name.endswith("mlp.experts.gate_up_proj"):
            for e in range(t.shape[0]):
                out[f"model.layers.{L}.mlp.experts.{e}.gate_proj.weight"] = t[e, :intermediate]
                out[f"model.layers.{L}.mlp.experts.{e}.up_proj.weight"] = t[e, intermediate:]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"model.layers.{L}.mlp.experts.{e}.down_proj.weight"] = t[e]
        else:
            out[f"model.layers.{L}.{name}"] = t
    return {k: v.clone().contiguous() for k, v in out.items()}


def test_mtp_depth_equals_transformers_and_round_trips(tmp_path):
    config = ds_config(num_hidden_layers=L, num_mtp_layers=1)
    hf = random_ds_model(config)
    torch.manual_seed(1)
    mtp = MtpModel(hf, 1).eval()
    with torch.no_grad():
        for name, p in mtp.layers.named_parameters():
            p.normal_(1.0, 0.2) if "norm" in name else p.normal_(0.0, 0.05)
        mtp.layers[0].mtp_block.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    folder = tmp_path / "hf"
    hf.save_pretrained(str(folder))  # config.json says num_nextn_predict_layers = 1
    files = read_folder(str(folder))
    files.update(_mtp_files(mtp, config.moe_intermediate_size))
    files[f"model.layers.{L}.embed_tokens.weight"] = files["model.embed_tokens.weight"].clone()
    files[f"model.layers.{L}.shared_head.head.weight"] = files["lm_head.weight"].clone()
    for f in folder.glob("*.safetensors"):
        f.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(files, str(folder / "model.safetensors"))

    args = hf_to_dcp(str(folder), str(tmp_path / "dcp"), progress=False)
    assert args.mtp_layers == 1
    reader = DcpModelReader(str(tmp_path / "dcp"))
    model = build_model(args).eval()
    model.load_state_dict({k: reader.load(k) for k in model.state_dict()})

    tokens = real_tokens()  # (2, 64)
    seq = tokens.shape[1]
    with torch.no_grad():
        last = hf.model(tokens).last_hidden_state  # after the final norm
        want = mtp._project_to_logits(
            mtp.forward_layer(
                0, last[:, :-1], torch.arange(seq - 1)[None], None, input_ids=tokens[:, 1:]
            )
        )
        embed = model.tok_embeddings(tokens)
        h0 = model.norm(model.layers["1"](model.layers["0"](embed, model.rope_cos,
                                                            model.rope_sin),
                                          model.rope_cos, model.rope_sin))  # fmt: skip
        h1 = model.mtp["0"](h0[:, :-1], embed[:, 1:], model.rope_cos, model.rope_sin)
        got = model.output(h1)
    diff = (got - want).abs().max().item()
    print(f"MTP depth 1: max |logits - transformers MtpModel| = {diff:.3g}")
    assert diff < 1e-4

    labels = torch.cat((tokens[:, 1:], torch.full((2, 1), -100)), dim=1)  # y_i = t_{i+1}
    with torch.no_grad(), mtp_targets(model, labels, 0.0):
        model(tokens)
    expected = F.cross_entropy(want.flatten(0, 1), labels[:, 1:].flatten(), reduction="sum")
    assert model.last_mtp_loss is not None
    assert abs(model.last_mtp_loss.item() - expected.item()) < 1e-3 * expected.item()

    dcp_to_hf(str(tmp_path / "dcp"), str(tmp_path / "hf2"), dtype=torch.float32, progress=False)
    back = read_folder(str(tmp_path / "hf2"))
    assert back.keys() == files.keys()
    assert all(torch.equal(back[k], files[k]) for k in files)


def _sliced_mtp_loss(model, inputs, labels):
    """The paper's form (§2.2), written independently of `mtp_loss_sum`: depth k runs over
    the seq - k positions that have a token k ahead, with the embedding sliced k places on."""
    embed = model.tok_embeddings(inputs)
    h = embed
    for block in model.layers.values():
        h = block(h, model.rope_cos, model.rope_sin)
    h = model.norm(h)
    seq, total = inputs.shape[1], 0.0
    for k in range(1, len(model.mtp) + 1):
        h = model.mtp[str(k - 1)](h[:, : seq - k], embed[:, k:], model.rope_cos, model.rope_sin)
        logits = model.output(h).float()
        total = total + F.cross_entropy(
            logits.flatten(0, 1), labels[:, k:].flatten(), ignore_index=-100, reduction="sum"
        )
    return h, total


@pytest.mark.parametrize("depths", [1, 2])
def test_the_mtp_gradient_is_the_weighted_loss_gradient(depths):
    """Inside `mtp_targets(model, labels, s)`, backward of the main loss alone gives every
    parameter the gradient of main + s · MTP loss (the trainer passes s = λ / D × its scale),
    where the MTP loss is the paper's shortened-sequence form: the model's full-length rolled
    form (Megatron-Core's) equals it, the filler positions reaching nothing."""
    import dataclasses

    from titanlab.models.deepseek_v3 import deepseek_v3_flavors

    args = dataclasses.replace(
        deepseek_v3_flavors["debugmodel"], vocab_size=97, max_seq_len=32, mtp_layers=depths
    )
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    tokens = torch.randint(0, 97, (2, 17))
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[0, 3] = -100  # an ignored label inside the sequence

    def main_loss(logits):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")

    with mtp_targets(model, labels, 0.3):
        main_loss(model(inputs)).backward()
    injected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    _, mtp = _sliced_mtp_loss(model, inputs, labels)
    h = model.tok_embeddings(inputs)
    for block in model.layers.values():
        h = block(h, model.rope_cos, model.rope_sin)
    (main_loss(model.output(model.norm(h))) + 0.3 * mtp).backward()
    assert model.last_mtp_loss is not None
    print(f"depths {depths}: MTP loss {model.last_mtp_loss.item():.6f} vs sliced {mtp.item():.6f}")
    torch.testing.assert_close(model.last_mtp_loss, mtp.detach(), rtol=1e-6, atol=1e-5)
    for n, p in model.named_parameters():
        assert p.grad is not None, n
        d = (injected[n] - p.grad).abs().max().item()
        assert d <= 1e-7 + 1e-5 * p.grad.abs().max().item(), (n, d, p.grad.abs().max().item())
    assert injected["mtp.0.eh_proj.weight"].abs().sum() > 0


def test_the_fused_loss_head_gives_the_same_mtp_loss_and_gradients():
    """With `loss.fused_linear_cross_entropy` the head returns each depth's loss in chunks (its
    labels swapped per depth): the main and MTP losses and every gradient equal the logits
    path's."""
    import copy
    import dataclasses

    from titanlab.components.fused_head import fused_targets, use_fused_loss
    from titanlab.models.deepseek_v3 import deepseek_v3_flavors

    args = dataclasses.replace(deepseek_v3_flavors["debugmodel"], vocab_size=97, max_seq_len=32)
    torch.manual_seed(0)
    plain = build_model(args)
    plain.init_weights()
    fused = copy.deepcopy(plain)
    use_fused_loss(fused, chunk_size=7)
    tokens = torch.randint(0, 97, (2, 17))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    with mtp_targets(plain, labels, 0.3):
        want = F.cross_entropy(plain(inputs).flatten(0, 1), labels.flatten(), reduction="sum")
        want.backward()
    with fused_targets(fused, labels), mtp_targets(fused, labels, 0.3):
        got = fused(inputs)
        got.backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(fused.last_mtp_loss, plain.last_mtp_loss, rtol=1e-6, atol=1e-5)
    grads = dict(fused.named_parameters())
    for n, p in plain.named_parameters():
        scale = p.grad.abs().max().item()
        assert (grads[n].grad - p.grad).abs().max().item() <= 1e-7 + 1e-5 * scale, n


@pytest.mark.parametrize("how", ["ac-full", "ac-selective", "compile"])
def test_the_depth_block_is_checkpointed_and_compiled_like_the_layers(how):
    """Activation checkpointing wraps the depth's block as it wraps the layers, and compile
    compiles its attention as in the layers' MoE blocks; the losses and gradients stay those
    of the plain model."""
    import copy
    import dataclasses

    from titanlab.distributed.activation_checkpoint import apply_ac
    from titanlab.distributed.compile import apply_compile
    from titanlab.models.deepseek_v3 import deepseek_v3_flavors

    args = dataclasses.replace(deepseek_v3_flavors["debugmodel"], vocab_size=97, max_seq_len=32)
    torch.manual_seed(0)
    plain = build_model(args)
    plain.init_weights()
    other = copy.deepcopy(plain)
    if how == "compile":
        torch._dynamo.reset()
        apply_compile(other, "aot_eager")
        assert other.mtp["0"].block.attention._compiled_call_impl is not None
    else:
        apply_ac(other, how.split("-")[1], "op")
        assert type(other.mtp["0"].block).__name__ == "CheckpointWrapper"
    tokens = torch.randint(0, 97, (2, 17))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    for model in (plain, other):
        with mtp_targets(model, labels, 0.3):
            F.cross_entropy(
                model(inputs).flatten(0, 1), labels.flatten(), reduction="sum"
            ).backward()
    torch.testing.assert_close(other.last_mtp_loss, plain.last_mtp_loss, rtol=1e-6, atol=1e-5)
    assert other.state_dict().keys() == plain.state_dict().keys()  # names unchanged
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in other.named_parameters()}
    for n, p in plain.named_parameters():
        scale = p.grad.abs().max().item()
        assert (grads[n].grad - p.grad).abs().max().item() <= 1e-7 + 1e-5 * scale, n
