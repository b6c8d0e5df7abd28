"""Protobuf schema of the codebook (wire and disk) and its generated Python modules."""
