"""Tensor parallel, applied from outside the model on the tp dims of the mesh
(`parallelism.tensor_parallel_mode`):
- `one_d`: 1D, Megatron-LM style with sequence parallel through `parallelize_module`
  (`apply_tp`, the float8 and LoRA styles, `linear_split_dims`, `block_comm_bytes`);
- `plan`: the 1D plan of one decoder block (`decoder_block_plan`, `SequenceParallel`,
  `ShardHeads` and the linear-attention plan);
- `mla`: the 1D plan of multi-head latent attention (`mla_attention_plan`);
- `lora`: the 1D column- and row-wise styles that split a LoRA adapter with its base Linear;
- `two_d`: 2D and 2.5D, the tp ranks as q × q grids over SUMMA products (`apply_tp_2d`);
- `three_d`: 3D, the tp ranks as a q × q × q cube (`apply_tp_3d`).

Import from the modules; this package's `__init__` imports nothing, so a caller that needs
only `two_d.grid_side` does not load the 1D plan and the models it reads.
"""
