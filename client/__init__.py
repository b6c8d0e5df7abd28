"""Site client: the ClientApp, its on-disk continual-learning state and its command line."""
