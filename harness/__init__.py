"""What the tests and the benchmarks run turnbus against, and never part of the product
(the wheel does not ship it): Redis servers, containers and a local Redis Cluster, the
fake model APIs in processes of their own, a fault proxy, a worker in the test's event
loop, and the one poll loop that waits on state with a deadline.

Imported from the checkout's root, as ``tests`` and ``benchmarks`` are (pytest puts the
root on ``sys.path``; the benchmarks run with ``PYTHONPATH=.``). It imports nothing from
``tests`` or ``benchmarks``.
"""
