"""What :class:`~tdstore.TensorDictStore` and :class:`~tdstore.LazyStackedTensorDictStore` are
both built on: the handle (:mod:`~tdstore.base.handle`), its layout cache, the refused and the
snapshot-based methods, the compatibility layer for older tensordict, the key views, and the
protocols the mixins are checked against. It imports neither :mod:`tdstore.store` nor
:mod:`tdstore.lazy`: both import it.
"""
