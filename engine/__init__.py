"""The one engine that prefill and decode instances share.

``scheduler`` (continuous batching, chunked prefill, preemption) and
``kv_cache_manager`` over ``block_pool`` (paged KV, prefix cache by block hash,
LRU eviction) decide each step; ``engine.EngineCore`` turns a scheduled
:class:`~pdserve.core.step.StepPlan` into tokens through an ``executor`` (the
seam to :mod:`pdserve.parallel`) and detokenizes them; ``loop.EngineLoop`` is
the one thread that owns an engine inside a serving instance. Free of Ray and
of sockets: the offline API, the role servers and the tests drive it directly.
"""
