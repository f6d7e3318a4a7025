"""Offline tools run from the CLI: `fdserve tune` and `fdserve calibrate`."""
