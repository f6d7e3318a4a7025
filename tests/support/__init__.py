"""Helpers the tests share: tiny models, a live server harness, paged-model drivers, FFD cases."""
