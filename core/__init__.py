"""The shared vocabulary of pdserve: configs and their validation, requests,
sampling parameters, step plans and messages, errors, the tokenizer wrapper,
built-in models and the metrics catalog. Free of Ray and of sockets."""
