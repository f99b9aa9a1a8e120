"""The decode instance: receives KV pages and generates in a continuous batch."""
