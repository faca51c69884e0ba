"""Benchmark harnesses behind `unbroken bench ...`.

This package sits above every library package: it may import anything in `unbroken`, and
nothing in the library imports it (checked by the import-layer contract). Each module holds
one benchmark's harness; `unbroken.cli` only parses arguments and calls in here.
"""
