"""The attention layer and its per-step metadata (layer.py), the backend interface (backend.py), its
implementations (dense.py, ffd.py, torch_reference.py) and the factory for `[flashdecoding]` (select.py)."""
