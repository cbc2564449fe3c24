"""Benchmarks: all methods in one process, interleaved, medians (``dart-ray bench``)."""
