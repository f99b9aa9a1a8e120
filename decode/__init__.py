"""The decode role: a small server around the shared engine that holds reserved pages
under leases, takes hand-offs and streams tokens to the routers."""
