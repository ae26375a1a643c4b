"""The decoding front ends: :func:`generate` (continuous batching through the engine, or one
compiled loop for a fixed batch: :mod:`compiled_loop`), :func:`beam_search` (jitted over either
cache; :mod:`beam_select` is HF's selection rule as one pure step).

May import every layer below it (core, table, cache, scale, prefix, engine). Must not import
:mod:`paxkv.scoring`, :mod:`paxkv.harness` or any model.
"""
