"""Aggregation server: the ServerApp phase loop, per-class merging and server-side replay."""
