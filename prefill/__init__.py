"""The prefill role: a small server around the shared engine that returns the first
token at once and streams the prompt's KV pages to a decode instance."""
