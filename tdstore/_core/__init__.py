"""Pure code, no I/O: key names, codecs, value encoding, chunk arithmetic, index math, write plans.

Nothing in this package talks to a server; each module is tested exhaustively without one.
"""
