"""Fuzzing of every reader of untrusted bytes (issue 20): mutators, targets, CI tests and a long-run script."""
