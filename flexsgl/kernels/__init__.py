"""flexsgl's own Triton kernels: the batch-1 projections with their norms folded in (gemv), q/k norm +
RoPE + the K/V write into the pool (rope_store), and how they launch (launch)."""
