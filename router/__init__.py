"""The global router (region and instance choice, the attempt lifecycle, admission)
and, in ``frontdoor``, the gRPC and OpenAI-compatible HTTP front doors."""
