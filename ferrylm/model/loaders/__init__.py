"""Loading checkpoints: model sources, GGUF and safetensors readers, dequantization."""
