"""The STAR-Prompt model: frozen backbones, both levels, losses, replay, local training, scoring."""
