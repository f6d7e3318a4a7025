"""The attention layer, its per-step metadata, and the backends behind `[flashdecoding]`."""
