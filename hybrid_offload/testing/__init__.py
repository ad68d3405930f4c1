"""Test harness shared by the tests, benchmarks and the demo: tiny models and the engine
session runner. Imports anything but the tools."""
