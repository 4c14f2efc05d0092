"""flexsgl's own Triton kernels: the batch-1 projections with their norms folded in (gemv), q/k norm +
RoPE + the K/V write into the pool (rope_store), MLA's latent store and latent query (latent_store,
latent_query), a batch-1 token's MoE layer (moe_layer), and how they launch (launch); and the plain
PyTorch expressions of RMSNorm and RoPE they follow (norm_rope). Kernels take tensors: nothing here
imports the models."""
