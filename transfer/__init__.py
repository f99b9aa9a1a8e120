"""Moving KV pages between instances: wire format, connectors, re-sharding."""
