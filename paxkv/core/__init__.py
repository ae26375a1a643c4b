"""What every layer of paxkv speaks: the written protocols, what one step feeds, the attention
plan beside it, the rounding rules, and the jitted steps that run any model over any cache.

* :mod:`protocol` — :class:`KVCache` and :class:`Model`: what a cache and a model provide.
* :mod:`step_info` — :class:`StepInfo`: positions, lengths and the plan of one step.
* :mod:`plan` — :class:`AttentionPlan` (a static hint beside the state) and its arithmetic.
* :mod:`packing` — :class:`Packing`: a prefill step's real tokens packed for the token-wise
  layers.
* :mod:`buckets` — every rounding rule (``cdiv``, batch widths, windows, prefix hints).
* :mod:`sampling` — sampling settings and the draw inside a step.
* :mod:`steps` — the jitted, donated prefill / decode steps and the compiled decode loop,
  written against the protocols only.
* :mod:`compiles` — JAX's persistent compilation cache turned on, and the compiles counted.
* :mod:`stored` — steps stored beside that cache as compiled executables: a new process skips
  tracing, lowering and compiling them; :mod:`program_key` names them.

May import: jax, numpy. Must not import any other part of paxkv, nor the kernels: everything
else imports this.
"""
