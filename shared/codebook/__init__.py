"""The codebook: the per-class schema, class entries and banks, immutable codebook values, their
lineage, wire format and files, merging, and the codebook a receiver holds and follows by deltas."""
