"""Probes, profilers and lab benchmarks of a running cluster: run from a checkout (`make hops`,
`make profile`, `make bench-live`…), never shipped in the wheel. `laneway bench` itself is a
product command (`infra/bench/`)."""
