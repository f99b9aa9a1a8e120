"""The global router and the front doors (gRPC, OpenAI-compatible HTTP)."""
