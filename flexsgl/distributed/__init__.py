"""Tensor parallelism across the GPUs of one host (see docs/ARCHITECTURE.md, "Tensor parallelism").

group.py     the process group of the ranks and the collectives the model runs
layers.py    how each weight is split across ranks, and the vocabulary-parallel layers
launcher.py  starting the ranks (spawned by LLM, or by torchrun) and refusing what cannot run
worker.py    rank 0's channel to the other ranks and the loop those ranks run
"""
