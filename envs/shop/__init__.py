"""WebShop-compatible shop engine: synthetic (or real WebShop) catalog, BM25 search, text
pages, WebShop's reward and an oracle. Entry point: `envs.shop.env.ShopEnv` (docs/shop.md)."""
