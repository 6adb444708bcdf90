"""The paged KV cache's bookkeeping, in pure Python: fixed-size blocks with reference counts,
a free queue and a prefix-hash map (`block_pool`), and request -> block table with
all-or-nothing allocation, trimming of rejected draft slots and freeing (`manager`). The
tensors that hold the keys and values belong to the model runners; this package owns which
block is whose."""
