"""The paged attention kernels with both contractions on tensor cores (WGMMA, Hopper), for
bfloat16 / float16 pages: :mod:`.decode` and :mod:`.prefill`, and :mod:`.geometry`, what they
can tile (SMEM and register budgets, refusals, the wrappers' shared checks). They share the
per-stage steps in :mod:`pallas_kernels._stream` with the CUDA-core kernels beside them.

Not imported by ``pallas_kernels`` itself: a cache loads them only when made with
``attention_impl="pallas_mma"``. They are not yet its default: they wait for a GPU
measurement (``bash experiments/on_gpu.sh``).
"""
