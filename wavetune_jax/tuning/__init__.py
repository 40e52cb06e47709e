"""Offline tooling (never imported at trace time): the profiler, sweeps, the
tuner, evaluation of policies and reports."""
