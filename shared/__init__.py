"""Code shared by the gateway and the worker: caps, keys, records, the stores and the Redis links.

Importing this package imports nothing else: the client reads :mod:`turnbus.shared.records`
and :mod:`turnbus.shared.events` without pulling in redis-py.
"""
