"""Model architectures (the Llama family) and their layers."""
