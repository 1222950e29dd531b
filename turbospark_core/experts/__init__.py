"""MoE experts held by the core, one concept per module.

* :mod:`~turbospark_core.experts.layout`: the ``experts.bin`` layout (manifest section), for the converter and the open.
* :mod:`~turbospark_core.experts.plan`: the residency plan, ``resident`` or ``streamed`` with ``expert_slots``.
* :mod:`~turbospark_core.experts.held`: records as arrays, in the form the compute policy holds them.
* :mod:`~turbospark_core.experts.store`: ``experts.bin`` opened; hands out each routed layer's bank once.
* :mod:`~turbospark_core.experts.streamed`: the streamed bank, an LRU of slots filled by positional reads.

Both residencies give bit-identical results: slots hold exactly what the
resident bank holds, and the same kernels run. Families see only the
:class:`~turbospark_core.layers.Experts` protocol.
"""
