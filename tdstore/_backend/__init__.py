"""Every byte that goes to the server: the IO loop, the scripts, the connection and its retry policy,
the operations (``ops``), indexed reads, armed writes, large transfers, cluster routing, credentials.

No module outside this package sends a command. The store classes speak to it through
:class:`~tdstore._backend.connection.Connection` and the functions of :mod:`tdstore._backend.ops`.
"""
