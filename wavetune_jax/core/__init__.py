"""The generic core: problems, families, backends, the registry, hardware and
the one tuned-op path every family's public op goes through."""
