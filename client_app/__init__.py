"""Client side: the Flower ClientApp adapter, the per-lane trainer service, trainer backends,
the multi-turn rollout loop and the RL algorithms."""
