"""The paged KV cache's bookkeeping: which block is whose (`block_pool`: reference counts, free
queue, prefix hashes; `manager`: request -> block table). The tensors belong to the runners."""
