"""Code shared by client, server and simulation: the STAR-Prompt model, replay, data, codebook."""
