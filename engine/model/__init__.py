"""The models: their files, the `ModelRunner`, native forwards, decode graphs, quantization."""
