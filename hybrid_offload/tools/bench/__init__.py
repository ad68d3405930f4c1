"""`hybrid-offload bench {backends,e2e,load}`: benchmarks that write JSON results and PNG plots
under ``benchmarks/results/`` and print a short table. One module per benchmark; shared helpers
(results files, machine description, tables, plots) in :mod:`hybrid_offload.tools.bench.common`."""
