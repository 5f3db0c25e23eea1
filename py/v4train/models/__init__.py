"""The two model families: configs from HF config.json, weight tables, layer functions."""
