"""The shared vocabulary of pdserve: configs, requests, errors, tokenizer, paged KV
block management, the scheduler and the engine core. Free of Ray and of I/O."""
