"""Running on the CPU: C kernels, packed and GGUF-block linears, thread affinity, malloc."""
