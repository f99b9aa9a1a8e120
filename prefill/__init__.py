"""The prefill instance: runs prompts and hands their KV pages to decode."""
