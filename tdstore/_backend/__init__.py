"""Every byte that goes to the server: the IO loop, the scripts, the connection and its retry policy,
the operations (``ops``), indexed reads and writes (``reads``, ``row_writes``), armed writes, large transfers, cluster routing, credentials,
and the probes of ``tdstore doctor`` (``probe``). ``translate`` is the one table from server errors
to tdstore's exceptions and retry classes.

No module outside this package sends a command (``tests/test_io_layer.py`` checks it). The store
classes speak to it through :class:`~tdstore._backend.connection.Connection` (opened by
:func:`~tdstore._backend.connect.open_connection`) and the functions of :mod:`tdstore._backend.ops`.
"""
