"""tdstore's conformance suite, reusable: check that a server can hold TensorDictStores.

Run it against a server of yours (a managed Redis, Dragonfly, KeyDB...) before trusting it::

    pytest --pyargs tdstore.testing --server-url redis://127.0.0.1:6379/15

The suite writes keys and runs ``FLUSHDB`` on the database of the URL after every test, so it
refuses a database that holds keys when it starts: give it an empty one. A host other than
loopback needs ``--allow-remote-server``. ``pip install 'tdstore[test]'`` brings what it needs
(pytest, fakeredis). See docs/deployment.md.

To run it on settings of your own, subclass :class:`TensorDictStoreTests` (see
:mod:`tdstore.testing.suite`).
"""

from __future__ import annotations

from tdstore.testing.suite import TensorDictStoreTests

__all__ = ["TensorDictStoreTests"]
