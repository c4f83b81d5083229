"""The small shop the env-service tests serve: 300 products, 1,000 goals (64 of them validation),
seed 0; a few seconds to build in a service subprocess."""

SHOP_PARAMS = {"num_products": 300, "num_goals": 1000, "val_size": 64, "seed": 0}
