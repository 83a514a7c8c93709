"""Code shared by the gateway and the worker: caps, keys, schemas, the envelope store."""
