"""Chunk KV off the device: the LMCache tier (CPU / disk / Redis), the host store of the
private-placement baselines, and the block copies between the paged cache and both."""
