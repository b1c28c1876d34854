"""`slotkeeper bench`: the benchmarks, one module per benchmark, and the harness they run on.

They ship in the package (not beside the tests) so that the command works from an installed wheel
and inside the image; what they drive beyond the runtime (upstream llama-server, moto, hypothesis,
matplotlib, ...) comes with the `bench` extra. `harness/` holds the servers, models and reports the
benchmarks share; the test suite reuses it for its own fixtures.
"""
