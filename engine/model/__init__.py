"""The models: where their files come from (a Hugging Face directory, a `.gguf` file converted
once, a file a package ships), the `ModelRunner` that loads one and runs packed-batch forward
passes over the paged cache, Tandem's own forward for the Llama family (`native`), CUDA-graph
decode, and weight-only quantization (`--quantization`)."""
