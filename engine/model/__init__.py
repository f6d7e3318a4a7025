"""Model code: building-block layers, RoPE, the Llama family, loading and synthetic weights."""
