"""Bundled data, not code: the tiny arithmetic task (its parquet train/val files) and the tiny model the default run
trains; read by path (run/prepare.py), imported by nothing."""
