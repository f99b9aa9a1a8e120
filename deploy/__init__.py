"""The pdserve command line, the Ray job entrypoint, configs and manifests."""
