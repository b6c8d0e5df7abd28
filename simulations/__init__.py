"""Scenarios (partitions, task streams), single-site training and the `flwr run` defaults."""
