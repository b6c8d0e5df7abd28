"""The codebook: the per-class schema, class entries and banks, wire format and files, merging."""
