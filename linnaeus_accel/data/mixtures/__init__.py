"""Mixtures of several sources by weight: each source's own data, their interleaving by the global
sample index, and the check that two sources do not overlap."""
