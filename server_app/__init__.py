"""Server side: the Flower ServerApp, its strategies and the round loop."""
