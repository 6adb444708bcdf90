"""Running on the CPU: the C kernels in `csrc/` (built once per machine by `build`, called
through ctypes by `kernels`), linear layers on packed weight panels (`linear`) and on a GGUF
file's own quantized blocks (`gguf_blocks`), the engine thread's cores (`affinity`) and
glibc's allocator told to keep freed memory (`memory`)."""
