"""The tests' own helpers (servers, hubs, pods, S3 servers, stores, the stand-in GPU),
imported by the test files, which import nothing from one another (tests/test_shape.py
checks). What the benchmarks share with the tests is testkit/, not this."""
