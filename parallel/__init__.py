"""Execution of one model shard on one rank: parallel layers, model families, the
checkpoint loader, paged attention backends and the model runner."""
