"""Context parallel: each sample's sequence split over the cp ranks of the mesh
(`parallelism.context_parallel_degree`), attention exchanging what the ranks lack:
- `torch_sdpa`: PyTorch's experimental `context_parallel` on causal SDPA, load-balanced
  head-tail chunks round the ring (`cp_context`);
- `cpu`: what torch 2.13's `context_parallel` lacks for the CPU flash kernel (`install`,
  `check_private_names`);
- `documents`: titanlab's own CP attention for document masks, sliding windows, sinks and
  Ulysses (`shard_batch`, `ContextParallelAttention`, `cp_attention`);
- `ring`: its ring attention with the `alltoall` rotation (`ring_attention`,
  `flex_ring_attention`);
- `collectives`: its differentiable collectives (`gather_sequence`, `sequence_to_heads`,
  `heads_to_sequence`, `shift`);
- `linear`: linear-attention layers under CP, the starting state from the ranks before
  (`starting_state`, `SequenceCarry`);
- `balance`: which tokens each rank holds (`shard_order`, the `work`, `head_tail` and `none`
  balancers);
- `torch_balancer`: those balancers as PyTorch's `_LoadBalancer` (`TitanlabLoadBalancer`).

Import from the modules; this package's `__init__` imports nothing, so a caller that needs
only `balance.shard_order` does not load torch's context-parallel API or the models' kernels.
"""
