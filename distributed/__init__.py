"""Where a rank sits in its instance and how ranks talk: the :class:`ParallelContext` its
layers are built with and the collectives they call (over ``torch.distributed`` or, between
ranks of one host, a shared-memory communicator)."""
